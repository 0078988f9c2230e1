"""The shape of nanoGPT's train.py (karpathy/nanoGPT), in miniature, as people run it: torchrun, DDP,
`get_batch` drawing random windows with a per-rank seed, the loss divided by the accumulation steps,
gradient clipping, a cosine LR with warmup, a periodic `estimate_loss`, a checkpoint.

    torchrun --standalone --nproc_per_node 2 examples/nanogpt/train_torchrun.py --batch_size 8

Compare examples/nanogpt/train.py: the same loop on `unison.Run` (docs/own-loop.md counts the changes).
"""

import argparse
import math
import os
import time

import torch
from model import GPT, GPTConfig, char_corpus
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", default="out-nanogpt")
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--block_size", type=int, default=64)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--max_iters", type=int, default=60)
parser.add_argument("--eval_interval", type=int, default=20)
parser.add_argument("--eval_iters", type=int, default=10)
parser.add_argument("--learning_rate", type=float, default=3e-3)
parser.add_argument("--warmup_iters", type=int, default=10)
parser.add_argument("--min_lr", type=float, default=3e-4)
parser.add_argument("--grad_clip", type=float, default=1.0)
args = parser.parse_args()

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.gradient_accumulation_steps //= world  # nanoGPT keeps tokens per iteration constant
else:
    rank, world = 0, 1
master_process = rank == 0
torch.manual_seed(1337 + rank)  # each rank draws its own windows

text = char_corpus()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split):
    source = train_data if split == "train" else val_data
    ix = torch.randint(len(source) - args.block_size, (args.batch_size,))
    x = torch.stack([source[i : i + args.block_size] for i in ix])
    y = torch.stack([source[i + 1 : i + 1 + args.block_size] for i in ix])
    return x, y


model = GPT(GPTConfig(vocab_size=len(chars), block_size=args.block_size))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split)
            losses[k] = model(x, y)[1].item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (
        args.learning_rate - args.min_lr
    )


x, y = get_batch("train")
t0 = t_last = time.time()
cpu_last = time.process_time()  # (this process's CPU time: what a loaded machine leaves the least noisy)
for iter_num in range(args.max_iters):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(args.gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == args.gradient_accumulation_steps - 1
        _, loss = model(x, y)
        loss = loss / args.gradient_accumulation_steps
        x, y = get_batch("train")
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1, cpu = time.time(), time.process_time()
    dt, dcpu, t_last, cpu_last = t1 - t_last, cpu - cpu_last, t1, cpu
    if master_process:
        lossf = loss.item() * args.gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, cpu {dcpu * 1000:.2f}ms")
if master_process:
    os.makedirs(args.out_dir, exist_ok=True)
    torch.save(
        {"model": raw_model.state_dict(), "iter_num": args.max_iters}, os.path.join(args.out_dir, "ckpt.pt")
    )
    print(f"time {time.time() - t0:.2f}s")
if ddp:
    destroy_process_group()

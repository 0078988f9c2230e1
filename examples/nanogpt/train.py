"""nanoGPT's train.py (karpathy/nanoGPT), in miniature, on `unison.Run`: examples/nanogpt/train_torchrun.py
with the changes docs/own-loop.md counts. The random windows `get_batch` drew on each rank are drawn once,
from one seed, and read as a dataset: so W processes train on one process's batches and reproduce its
loss curve, and a killed run resumes mid-way to the uninterrupted weights.

    python examples/nanogpt/train.py --batch_size 16                          # one process
    unison launch --nproc 2 examples/nanogpt/train.py --batch_size 8          # the same global batch
    unison launch --nproc 2 --max-restarts 1 examples/nanogpt/train.py --batch_size 8   # resumes
"""

import argparse
import json
import math
import os
import time

import torch
from model import GPT, GPTConfig, char_corpus
from torch.utils.data import DataLoader, Dataset

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", default="out-nanogpt")
parser.add_argument("--batch_size", type=int, default=16, help="per process")
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

run = unison.Run(accumulate=args.gradient_accumulation_steps, path=args.out_dir)
master_process = run.is_main
torch.manual_seed(1337)  # the same on every rank: one model, one set of windows

text = char_corpus()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


class Windows(Dataset):
    """`count` random windows of `source`, drawn once from `seed`: get_batch's draws, as a dataset."""

    def __init__(self, source, count, seed):
        self.source = source
        self.starts = torch.randint(
            len(source) - args.block_size, (count,), generator=torch.Generator().manual_seed(seed)
        )

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        return self.source[s : s + args.block_size], self.source[s + 1 : s + 1 + args.block_size]


global_batch = args.batch_size * int(os.environ.get("WORLD_SIZE", 1))
train_windows = Windows(train_data, args.max_iters * args.gradient_accumulation_steps * global_batch, seed=1)
eval_windows = {
    split: Windows(src, args.eval_iters * global_batch, seed=2)
    for split, src in [("train", train_data), ("val", val_data)]
}

model = GPT(GPTConfig(vocab_size=len(chars), block_size=args.block_size))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
model, optimizer = run.setup(model, optimizer)
run.add_cb(unison.GradientClip(args.grad_clip))  # at each real step, on the global batch's gradient
train = run.loader(DataLoader(train_windows, batch_size=args.batch_size))
evals = {
    split: run.loader(DataLoader(w, batch_size=args.batch_size), train=False)
    for split, w in eval_windows.items()
}
run.checkpoint(every=args.eval_interval * args.gradient_accumulation_steps)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split, loader in evals.items():
        total = count = 0.0
        for x, y in loader:  # every window once over the ranks: the mean is one process's
            sums = run.gather(model(x, y, reduction="none")[1].view(len(y), -1).sum(1))
            total, count = total + float(sums.sum()), count + sums.numel() * args.block_size
        out[split] = total / count
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (
        args.learning_rate - args.min_lr
    )


t0 = t_last = time.time()
cpu_last = time.process_time()  # (this process's CPU time: what a loaded machine leaves the least noisy)
with run:
    for _ in run.epochs(1, resume=True):  # one pass over the run's windows
        model.train()
        for x, y in train:
            iter_num = run.batch // args.gradient_accumulation_steps
            for group in optimizer.param_groups:
                group["lr"] = get_lr(iter_num)
            if run.batch % (args.eval_interval * args.gradient_accumulation_steps) == 0:
                losses = estimate_loss()
                run.print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            _, loss = model(x, y, reduction="sum")
            run.backward(run.loss(loss, count=y.numel()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (run.batch + 1) % args.gradient_accumulation_steps == 0:  # an optimizer step ended
                t1, cpu = time.time(), time.process_time()
                dt, dcpu, t_last, cpu_last = t1 - t_last, cpu - cpu_last, t1, cpu
                lossf = loss.item() / y.numel()
                run.print(
                    f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, cpu {dcpu * 1000:.2f}ms"
                )
    if master_process:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(
            {"model": run.model.state_dict(), "iter_num": args.max_iters},
            os.path.join(args.out_dir, "ckpt.pt"),
        )
        with open(os.path.join(args.out_dir, "losses.json"), "w") as f:
            json.dump(run.recorder.losses, f)  # each micro-batch's loss over the global batch
        print(f"final loss {run.recorder.losses[-1]:.4f}; time {time.time() - t0:.2f}s")

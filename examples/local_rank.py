"""A script that makes its own process group and reads `--local_rank` (the style of
torch.distributed.launch and fastai v1's distributed guide), with unison.

The script parses `--local_rank`, binds its GPU (when there is one), makes the process group
itself with `init_method="env://"`, then hands the learner to that group with
`learn.to_distributed(args.local_rank)` and `metrics=accuracy`, as such scripts write them. On a
CPU machine the only edits are gloo for nccl and no `torch.cuda.set_device` (a CPU build of
torch has none); `to_distributed(local_rank)` then trains on the CPU. It runs unchanged under
every launcher:

    unison launch --nproc_per_node=2 --legacy-local-rank examples/local_rank.py  # --local_rank=N
    torchrun --standalone --nproc-per-node 2 examples/local_rank.py      # LOCAL_RANK in the env
    unison launch --gpus 0,1 --legacy-local-rank examples/local_rank.py  # NCCL, one GPU each

Each rank ends by printing `rank R weights_sum S sha256 H`: the same on every rank (DDP keeps
the replicas identical), and the same under either launcher (same seed, same world size).
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, accuracy, set_seed

parser = argparse.ArgumentParser(description="A script that makes its own process group.")
# torch.distributed.launch passed --local_rank (newer torch: --local-rank); torchrun sets LOCAL_RANK.
parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(args.local_rank)
dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")

# A tiny synthetic classification set, the same on every rank (same seed).
set_seed(42)
x = torch.randn(256, 10)
y = (x[:, :5].sum(1) > x[:, 5:].sum(1)).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:192], y[:192]), batch_size=16, shuffle=True),
    DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32),
)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=accuracy).to_distributed(args.local_rank)
learn.fit_one_cycle(args.epochs, 1e-2)
valid_loss, valid_acc = learn.validate()
learn.detach_distributed()  # the group is the script's: unison leaves it alone

flat = torch.cat([p.detach().cpu().double().flatten() for p in learn.model.parameters()])
digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
rank = dist.get_rank()
print(f"rank {rank} weights_sum {flat.sum().item():.10f} sha256 {digest} valid_acc {valid_acc:.4f}")
dist.destroy_process_group()

"""A small resumable job that says where it is, so that a test can deal it a fault from outside.

unison launch --nproc 2 --max-restarts 1 cluster_job.py --dir D --cue-rank 1 --at 5 --cue wait
unison launch --nproc 2 cluster_job.py --dir D --cue-rank 1 --at 5 --cue exit --plain

At training step `--at`, rank `--cue-rank` writes its pid to `D/cue` (whole: written beside it,
then renamed), once per job (never again after a restart), and then, by `--cue`:
  wait   waits (up to 60 s) for the test to act on it (a SIGKILL from outside)
  oom    waits for `D/go` (the test has moved it into a small memory cgroup), then allocates
         until the kernel's OOM killer ends it
  exit   calls sys.exit(0) there
  mark   goes on training (the test closes a pipe or sends SIGTERM meanwhile)
  hold   every rank waits there (up to 60 s, outside any collective) for `D/go`: the test cuts a
         network link meanwhile, and lets several jobs run into the cut at once
`--step-s` sleeps that long each step, so that a job lasts long enough for the test to act.
`--plain` trains as a torchrun script does (its own gloo group and DDP, no unison Learner).
Every rank prints `WEIGHTS rank<R> <sha256 of its final weights>` at the end, and `STEPS rank<R> <n>`:
the training steps of its last attempt (8 for a whole run of 2 epochs; fewer for a resumed one).
"""

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--cue-rank", type=int, default=-1)
parser.add_argument("--cue", choices=("wait", "oom", "exit", "mark", "hold"), default="mark")
parser.add_argument("--at", type=int, default=5, help="training step (counted over the run) of the cue")
parser.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes")
parser.add_argument("--keep-on-term", action="store_true", help="a SIGTERM handler that notes it and goes on")
parser.add_argument("--plain", action="store_true", help="torch only: init_process_group and DDP")
args = parser.parse_args()
CUE, GO = os.path.join(args.dir, "cue"), os.path.join(args.dir, "go")


def write_whole(path: str, text: str) -> None:
    with open(path + ".part", "w") as fh:
        fh.write(text)
    os.replace(path + ".part", path)


def wait_for(path: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def after_step(step: int, rank: int) -> None:
    """Called after each optimizer step (counted from 1 over the run)."""
    if args.step_s:
        time.sleep(args.step_s)
    if step != args.at or os.path.exists(GO if args.cue == "hold" else CUE):
        return
    if args.cue == "hold":
        if rank == args.cue_rank:
            write_whole(CUE, str(os.getpid()))
        wait_for(GO)
        return
    if rank != args.cue_rank:
        return
    write_whole(CUE, str(os.getpid()))
    if args.cue == "wait":
        time.sleep(60)
    elif args.cue == "oom":
        wait_for(GO)
        hoard = []
        for _ in range(400):  # 20 GB at most: the cgroup's limit ends it long before
            hoard.append(torch.ones(50_000_000 // 4))
    elif args.cue == "exit":
        sys.exit(0)


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()


if args.keep_on_term:
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM noted; going on", flush=True))
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

if args.plain:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    step = 0
    for _ in range(args.epochs):
        for start in range(rank * 8, 64, world * 8):
            loss = nn.functional.cross_entropy(ddp(x[start : start + 8]), y[start : start + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            after_step(step, rank)
    print(f"WEIGHTS rank{rank} {digest(model)}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

from unison import Callback, Checkpoint, DataLoaders, Learner, set_seed  # noqa: E402
from unison.distributed import rank_distrib  # noqa: E402


class Cue(Callback):
    order = 95  # after Checkpoint wrote this step's state

    def __init__(self):
        self.steps = 0  # of this attempt (the cue comes once per job anyway)

    def after_step(self):
        self.steps += 1
        after_step(self.steps, rank_distrib())


set_seed(0)
dls = DataLoaders(
    DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True, num_workers=args.loader_workers),
    DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8),
)
cue = Cue()
# --keep-on-term: a worker that ignores SIGTERM (its handler alone; no preemption handling)
on_preempt = None if args.keep_on_term else "stop"
learn = Learner(
    dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=args.dir, cbs=[Checkpoint(every=1), cue],
    on_preempt=on_preempt,
)  # fmt: skip
learn.recorder.print_table = False
with learn.distrib_ctx():
    learn.fit_one_cycle(args.epochs, resume=True)
print(f"WEIGHTS rank{rank_distrib()} {digest(learn.raw_model)}", flush=True)
print(f"STEPS rank{rank_distrib()} {cue.steps}", flush=True)  # trained by this attempt (resumed: fewer)

"""A small resumable job that sends a preemption signal to itself or to its launcher on cue.

unison launch --nproc 2 preemptible.py --dir D --phase save --at 3 --to launcher    # exits 75
unison launch --nproc 2 preemptible.py --dir D                                      # resumes

Rank `--rank` sends `--signal` to `--to` (itself, or the `unison launch` that started it, as a
scheduler would) once per folder (a file `D/sent` marks it), at training step `--at` (counted
over the run, from 1) by `--phase`:
  step      after that step
  validate  in the first validation batch after that step
  save      as the first checkpoint write after that step begins
  ready     writes `D/ready` after that step, and sends nothing (the test sends it, from outside)
Checkpoint(every=--every): a signal between two saves makes the preemption write one.
Every rank prints `WEIGHTS rank<R> <sha256 of its final weights>` at the end.
"""

import argparse
import hashlib
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, Checkpoint, DataLoaders, Learner, set_seed
from unison.checkpoint import store as checkpoint_store
from unison.distributed import rank_distrib

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--phase", choices=("step", "validate", "save", "ready"), default="step")
parser.add_argument("--at", type=int, default=0, help="training step of the cue (0: none)")
parser.add_argument("--rank", type=int, default=0, help="the rank that sends it")
parser.add_argument("--to", choices=("self", "launcher"), default="self")
parser.add_argument("--signal", default="SIGTERM")
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps")
parser.add_argument("--on-preempt", default="stop")
parser.add_argument("--shard", action="store_true", help="FSDP2: distrib_ctx(shard=True)")
args = parser.parse_args()
os.makedirs(args.dir, exist_ok=True)
SENT = os.path.join(args.dir, "sent")


def send() -> None:
    if rank_distrib() != args.rank or os.path.exists(SENT) or not args.at:
        return
    open(SENT, "w").close()
    target = int(os.environ["UNISON_LAUNCHER_PID"]) if args.to == "launcher" else os.getpid()
    os.kill(target, getattr(signal, args.signal))


class Cue(Callback):
    order = 96  # after Checkpoint and Preemption had this step

    def __init__(self):
        self.steps, self.armed = 0, False

    def after_step(self):
        self.steps += 1
        if args.step_s:
            time.sleep(args.step_s)
        if self.steps == args.at:
            self.armed = True
            if args.phase == "step":
                send()
            elif args.phase == "ready" and rank_distrib() == args.rank:
                open(os.path.join(args.dir, "ready"), "w").close()

    def after_pred(self):
        if not self.learn.training and self.armed and args.phase == "validate":
            send()


real_atomic_save = checkpoint_store.atomic_save


def atomic_save(*a, **k):
    if CUE.armed and args.phase == "save":
        send()  # the write below runs while the signal is delivered and handled
    return real_atomic_save(*a, **k)


checkpoint_store.atomic_save = atomic_save
CUE = Cue()

set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g)
y = (x[:, 0] > 0).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),
    DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8),
)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
on_preempt = None if args.on_preempt == "none" else args.on_preempt
learn = Learner(
    dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=args.dir, cbs=[Checkpoint(every=args.every), CUE],
    on_preempt=on_preempt,
)  # fmt: skip
learn.recorder.print_table = False
with learn.distrib_ctx(shard=args.shard):
    learn.fit_one_cycle(args.epochs, resume=True)
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in learn.raw_model.state_dict().values()))
print(f"WEIGHTS rank{rank_distrib()} {digest.hexdigest()}", flush=True)

"""An own loop on `unison.Run` that can be killed or preempted on cue (tests/test_run_launch.py).

unison launch --nproc 2 --max-restarts 1 own_loop.py --dir D --kill-rank 1 --at 5
unison launch --nproc 2 own_loop.py --dir D --wait-at 5        # then SIGTERM: exit 75, checkpointed
unison launch --nproc 2 own_loop.py --dir D --wait-at 5 --slow-after-signal 5   # rank 0 slow after it
python own_loop.py --dir D --bs 16                               # the uninterrupted one-process run
unison launch --nproc 2 --max-restarts 1 own_loop.py --dir D --shard --kill-rank 1 --at 5   # FSDP2, DCP
unison launch --nproc 2 --max-restarts 1 own_loop.py --dir D --sched --kill-rank 1 --at 5   # + OneCycleLR

Trains a BatchNorm MLP with AdamW in float64, sequential order, 2 epochs of 6 steps of a global
batch of 16 (on W processes `--bs 16/W`), a checkpoint after every step, resumed with `resume=True`;
rank 0 saves the final weights to D/final.pt. `--sched`: a OneCycleLR given to `run.setup`, stepped
after every batch (it steps at real optimizer steps).
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Run, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--bs", type=int, default=8, help="per process")
parser.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL itself (first attempt only)")
parser.add_argument("--wait-at", type=int, default=-1, help="write D/waiting, wait for SIGTERM at this step")
parser.add_argument(
    "--slow-after-signal", type=float, default=0.0, help="rank 0 then takes this long (healthy, slow)"
)
parser.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps forever at --at")
parser.add_argument("--at", type=int, default=5, help="the training step (counted over the run)")
parser.add_argument("--shard", action="store_true", help="Run(shard=True): FSDP2, DCP checkpoints")
parser.add_argument("--sched", action="store_true", help="a OneCycleLR over the 12 steps, given to run.setup")
args = parser.parse_args()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def wait_for_the_signal(limit_s: float = 60.0) -> None:
    """Stay in this step until SIGTERM has reached this process (the test sends it to the launcher
    once D/waiting exists; on a loaded machine that takes a while), then let Run's handler have it."""
    arrived = []
    run_handler = signal.getsignal(signal.SIGTERM)

    def note(sig, frame):
        arrived.append(sig)
        if callable(run_handler):
            run_handler(sig, frame)

    signal.signal(signal.SIGTERM, note)
    deadline = time.monotonic() + limit_s
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, run_handler)


set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g, dtype=torch.float64)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)).double()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
original = model  # (sharded, it gets the whole trained weights back when the run closes)

with Run(path=args.dir, shard=args.shard) as run:
    if args.sched:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=12)
        model, opt, sched = run.setup(model, opt, sched)
    else:
        model, opt = run.setup(model, opt)
    train = run.loader(DataLoader(TensorDataset(x, y), batch_size=args.bs))
    run.checkpoint(every=1)
    step = 0
    for _ in run.epochs(2, resume=True):
        model.train()
        for xb, yb in train:
            loss = run.loss(F.cross_entropy(model(xb), yb, reduction="sum"), count=len(yb))
            run.backward(loss)
            opt.step()
            opt.zero_grad()
            if args.sched:
                sched.step()
            step += 1
            if step == args.at and first_attempt and run.rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.at and run.rank == args.hang_rank:
                Path(args.dir, "hung_at").write_text(repr(time.time()))  # the test's clock starts here
                time.sleep(10_000)
            if step == args.wait_at and first_attempt:
                Path(args.dir, "waiting").write_text(str(run.rank))
                wait_for_the_signal()  # the step boundary then checkpoints and stops
                if run.rank == 0:
                    time.sleep(args.slow_after_signal)  # longer than the stall limit: slow, not stuck
    if run.is_main:
        torch.save(run.model.state_dict(), Path(args.dir) / "final.pt")
if args.shard and run.is_main:  # (the sharded weights above are this rank's shards: the whole ones)
    torch.save(original.state_dict(), Path(args.dir) / "final.pt")

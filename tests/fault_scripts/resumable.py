"""A resumable training script whose ranks can be made to crash or hang on cue (fault tests).

unison launch --nproc 2 --max-restarts 1 resumable.py --dir D --kill-rank 1 --at 5
unison launch --nproc 2 --max-restarts 1 resumable.py --dir D --torn-rank 1 --torn '{"mess' --at 5
unison launch --nproc 2 --max-restarts 1 resumable.py --dir D --lr-scheduler --kill-rank 1 --at 11
(`--lr-scheduler`: torch's OneCycleLR through LRSchedulerCallback instead of fit_one_cycle)
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

from unison import Callback, Checkpoint, DataLoaders, Learner, LRSchedulerCallback, set_seed
from unison.distributed import rank_distrib

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL itself (first attempt)")
parser.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps forever inside a step")
parser.add_argument("--freeze-rank", type=int, default=-1, help="this rank SIGSTOPs itself after a step")
parser.add_argument("--exit-rank", type=int, default=-1, help="this rank's script exits early (status 0)")
parser.add_argument("--torn-rank", type=int, default=-1, help="killed while writing its error file")
parser.add_argument("--torn", default="", help="...what it had written of it when killed (empty: nothing)")
parser.add_argument("--at", type=int, default=5, help="...at this training step (counted over the run)")
parser.add_argument("--lr-scheduler", action="store_true", help="LRSchedulerCallback(OneCycleLR)")
args = parser.parse_args()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class Fault(Callback):
    order = 95  # after Checkpoint wrote this step's state

    def __init__(self):
        self.steps = 0

    def after_step(self):
        self.steps += 1
        if self.steps == args.at and first_attempt:
            if rank_distrib() == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank_distrib() == args.exit_rank:
                sys.exit(0)
            if rank_distrib() == args.torn_rank:  # as torch's @record is, when stopped mid-write
                with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as error_file:
                    error_file.write(args.torn)
                    error_file.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            if rank_distrib() == args.hang_rank:
                with open(os.path.join(args.dir, "hung_at"), "w") as fh:  # the test's clock starts here
                    fh.write(repr(time.time()))
                time.sleep(10_000)
            if rank_distrib() == args.freeze_rank:  # paused, swapped out: every thread stops
                with open(os.path.join(args.dir, "frozen_at"), "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)


set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g)
y = (x[:, 0] > 0).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),
    DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8),
)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=args.dir, cbs=[Checkpoint(every=1), Fault()])
with learn.distrib_ctx():
    if args.lr_scheduler:  # 2 epochs of 4 steps of a global batch of 16
        one_cycle = lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=8)  # noqa: E731
        learn.fit(2, cbs=[LRSchedulerCallback(one_cycle)], resume=True)
    else:
        learn.fit_one_cycle(2, resume=True)
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in learn.raw_model.state_dict().values()))
print(f"WEIGHTS rank{rank_distrib()} {digest.hexdigest()}", flush=True)

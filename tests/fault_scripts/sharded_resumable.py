"""A resumable sharded (FSDP2) training script whose ranks can be made to crash or hang on cue.

unison launch --nproc 2 --max-restarts 1 sharded_resumable.py --dir D --kill-rank 1 --at 5
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
from unison.distributed import rank_distrib

first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
args = argparse.Namespace(kill_rank=-1, hang_rank=-1, at=5)  # set by main()


class Fault(Callback):
    order = 95  # after Checkpoint wrote this step's state

    def __init__(self):
        self.steps = 0

    def after_step(self):
        self.steps += 1
        if self.steps == args.at and first_attempt:
            if rank_distrib() == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank_distrib() == args.hang_rank:
                with open(os.path.join(args.dir, "hung_at"), "w") as fh:  # the test's clock starts here
                    fh.write(repr(time.time()))
                time.sleep(10_000)


def build_learner(folder, cbs=()):
    """The job's learner: the same model, data and order wherever it is built."""
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    return Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=folder, cbs=[Checkpoint(every=1), *cbs])


def train(folder, cbs=()):
    """Train sharded (resuming if a checkpoint exists); the digest of the final weights."""
    learn = build_learner(folder, cbs)
    with learn.distrib_ctx(shard=True):
        learn.fit_one_cycle(2, resume=True)
    return hashlib.sha256(
        b"".join(t.numpy().tobytes() for t in learn.raw_model.state_dict().values())
    ).hexdigest()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL itself (first attempt)")
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps forever inside a step")
    parser.add_argument("--at", type=int, default=5, help="...at this training step (counted over the run)")
    args = parser.parse_args()
    digest = train(args.dir, [Fault()])
    print(f"WEIGHTS rank{rank_distrib()} {digest}", flush=True)

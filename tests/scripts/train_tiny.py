"""A tiny unison training run for the launch tests: any launcher, any number of processes.

Rank 0 prints `RESULT {"valid": [...], "weights": ...}` (validation values and a weights
checksum after 2 epochs); every rank prints `RANKINFO {...}` to stderr (its rank variables,
GLOO_SOCKET_IFNAME, torch threads and its own weights checksum).

    unison launch --nproc 2 tests/scripts/train_tiny.py
    unison launch --nproc 2 --max-restarts 1 tests/scripts/train_tiny.py --ckpt DIR --crash 5

With `--ckpt DIR` it checkpoints every step into DIR and fits with `resume=True`; with
`--crash N` rank 1 kills itself (SIGKILL) before training step N of the first attempt, so the
restarted job must resume from the last checkpoint and still end on the same weights.
With `--crash-once MARKER` (besides `--crash N`) the process given it kills itself at step N
if MARKER does not exist yet (it creates it first), whatever its rank and restart count: the
multi-node tests pass it to one node's command only, whose restart count may differ.
"""

import argparse
import json
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, Checkpoint, DataLoaders, Learner, accuracy, set_seed
from unison.distributed import rank_distrib

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", help="checkpoint every step into this folder, fit with resume=True")
parser.add_argument("--crash", type=int, help="rank 1 dies before this training step, first attempt only")
parser.add_argument("--crash-once", help="this process dies at --crash unless this marker file exists")
parser.add_argument("--bs", type=int, default=8, help="batch size per process (1 process at 16 = 2 at 8)")
args = parser.parse_args()


class CrashOnce(Callback):
    def before_batch(self) -> None:
        if args.crash_once:
            here = self.learn.training and self.learn.train_iter == args.crash
            if here and not os.path.exists(args.crash_once):
                open(args.crash_once, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        here = self.learn.training and self.learn.train_iter == args.crash
        if here and first_attempt and rank_distrib() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


set_seed(0)
x = torch.randn(96, 6)
y = (x @ torch.arange(1.0, 7.0) > 0).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:64], y[:64]), batch_size=args.bs, shuffle=True),  # 64 = 2 ranks x 8 x 4
    DataLoader(TensorDataset(x[64:], y[64:]), batch_size=10),
)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
cbs = [Checkpoint(every=1)] if args.ckpt else []
cbs += [CrashOnce()] if args.crash is not None else []
learn = Learner(
    dls, model, nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, metrics=[accuracy], cbs=cbs,
    path=args.ckpt or ".",
)  # fmt: skip
learn.recorder.print_table = False
with learn.distrib_ctx():
    learn.fit(2, resume=bool(args.ckpt))
    valid = learn.validate()
    rank = rank_distrib()
weights = float(sum(p.detach().double().abs().sum() for p in learn.model.parameters()))
info = {
    k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME")
}
info.update(threads=torch.get_num_threads(), weights=weights)
print("RANKINFO " + json.dumps(info), file=sys.stderr)
if rank == 0:
    print("RESULT " + json.dumps({"valid": valid, "weights": weights}))

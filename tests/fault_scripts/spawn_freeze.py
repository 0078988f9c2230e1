"""`unison.spawn` with one rank frozen (SIGSTOP) mid-training: the call must end, naming it.

python spawn_freeze.py DIR FROZEN_RANK TIMEOUT
"""

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison
from unison import Callback, DataLoaders, Learner, set_seed
from unison.distributed import rank_distrib


class Freeze(Callback):
    order = 95

    def __init__(self, folder: str, rank: int, at: int = 3):
        self.folder, self.rank, self.at, self.steps = folder, rank, at, 0

    def after_step(self):
        self.steps += 1
        if self.steps == self.at and rank_distrib() == self.rank:
            with open(os.path.join(self.folder, "frozen_at"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # paused, swapped out: every thread stops


def train(folder: str, frozen: int) -> float:
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, cbs=[Freeze(folder, frozen)])
    with learn.distrib_ctx():
        learn.fit(2)
    return learn.validate()[0]


if __name__ == "__main__":
    folder, frozen, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    try:
        unison.spawn(train, nprocs=2, args=(folder, frozen), timeout=timeout)
    except unison.SpawnError as err:
        print(f"SPAWN ERROR: {err}", flush=True)
        sys.exit(3)
    print("SPAWN RETURNED", flush=True)

"""A tiny unison training run for the launch tests: any launcher, any number of processes.

Rank 0 prints `RESULT {"valid": [...], "weights": ...}` (validation values and a weights
checksum after 2 epochs); every rank prints `RANKINFO {...}` to stderr (its rank variables,
GLOO_SOCKET_IFNAME, torch threads and its own weights checksum).

    unison launch --nproc 2 tests/scripts/train_tiny.py
"""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.distributed import rank_distrib

set_seed(0)
x = torch.randn(96, 6)
y = (x @ torch.arange(1.0, 7.0) > 0).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),  # 64 = 2 ranks x 8 x 4
    DataLoader(TensorDataset(x[64:], y[64:]), batch_size=10),
)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, metrics=[accuracy])
learn.recorder.print_table = False
with learn.distrib_ctx():
    learn.fit(2)
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

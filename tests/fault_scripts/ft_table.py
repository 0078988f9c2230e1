"""A fault-tolerant replica with the default callbacks (its table printed), for the readable-log tests.

TORCHFT_LIGHTHOUSE=http://host:port python ft_table.py --replica a --start-replicas 2
python ft_table.py --plain                                   # the one-process reference

Prints `VALUES {json}` at the end: the recorder's epoch rows and every step's training loss.
"""

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--replica", default="")
parser.add_argument("--plain", action="store_true")
parser.add_argument("--start-replicas", type=int, default=1)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(120, 8, generator=g)
y = (x[:, 0] + x[:, 1] > 0).long()
dls = DataLoaders(
    DataLoader(TensorDataset(x[:96], y[:96]), batch_size=12, shuffle=True),
    DataLoader(TensorDataset(x[96:], y[96:]), batch_size=16),
)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, lr=1e-2)
if args.plain:
    learn.fit(args.epochs)
else:
    ft = {"replica_id": args.replica, "min_replicas": 2, "start_replicas": args.start_replicas}
    with learn.distrib_ctx(fault_tolerant=ft, timeout=20):
        learn.fit(args.epochs)
print("VALUES " + json.dumps({"values": learn.recorder.values, "losses": learn.recorder.losses}), flush=True)

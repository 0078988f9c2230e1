"""Train a small CNN on scikit-learn's 8x8 digits (shipped with scikit-learn, no download).

One script for every setting:

    python examples/train_digits.py --out runs/digits            # one process
    unison launch --nproc 2 examples/train_digits.py --bs 32     # two CPU processes, same global batch

It prints the table of epochs, then `valid_loss` and `valid_accuracy`, and writes
`<out>/loss.png`, `<out>/models/digits.pth` and `<out>/history.json` (the per-batch loss curve
and the per-epoch values: `examples/demo.py` compares a 1-process and a 2-process run with it).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Checkpoint, DataLoaders, Learner, accuracy, set_seed
from unison.distributed import rank_distrib

parser = argparse.ArgumentParser(description="Small CNN on scikit-learn's digits with unison.")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs")
parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle schedule")
parser.add_argument("--bs", type=int, default=64, help="batch size per process")
parser.add_argument("--out", type=Path, default=Path("."), help="folder for loss.png and models/")
parser.add_argument(
    "--every", type=int, help="Checkpoint(every=N) and fit(resume=True): a run stopped or preempted goes on"
)
args = parser.parse_args()
start = time.perf_counter()
set_seed(42)

# Data: 1797 grey 8x8 images with values 0..16, as (N, 1, 8, 8) floats in [0, 1].
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # a fixed split
x, y = x[order], y[order]
n_valid = len(x) // 5  # the last 20% for validation
train_ds = TensorDataset(x[:-n_valid], y[:-n_valid])
valid_ds = TensorDataset(x[-n_valid:], y[-n_valid:])
dls = DataLoaders(
    DataLoader(train_ds, batch_size=args.bs, shuffle=True),
    DataLoader(valid_ds, batch_size=2 * args.bs),
)


# Model: two conv blocks with BatchNorm (8x8 -> 4x4 -> 2x2), then a linear head.
def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


model = nn.Sequential(conv_block(1, 32), conv_block(32, 64), nn.Flatten(), nn.Linear(64 * 2 * 2, 10))
cbs = [Checkpoint(every=args.every)] if args.every else []  # a preemption signal also writes one at once
learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=[accuracy], path=args.out, cbs=cbs)

# Training: a plain run here, data-parallel under `unison launch` (BatchNorm synchronised).
with learn.distrib_ctx():
    learn.fit_one_cycle(args.epochs, args.lr, resume=bool(args.every))
    valid_loss, valid_acc = learn.validate()  # exact over the whole valid set, on every rank
    learn.recorder.plot_loss(args.out / "loss.png")  # rank 0 writes
    model_file = learn.save("digits")  # rank 0 writes, atomically

    if rank_distrib() == 0:
        history = {"batch_losses": learn.recorder.losses, "epochs": learn.recorder.values}
        (args.out / "history.json").write_text(json.dumps(history))
        print(f"valid_loss {valid_loss:.4f}")
        print(f"valid_accuracy {valid_acc:.4f}")
        print(f"saved {model_file} and {args.out / 'loss.png'} in {time.perf_counter() - start:.1f}s")

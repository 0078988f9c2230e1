"""Train on a stream: scikit-learn's digits written to shard files, read back by an `IterableDataset`.

The dataset is a generator over files with no `len()`, as a stream over data that does not fit in
memory is. unison shards it across processes (every rank reads the stream and keeps its stride;
DataLoader workers split further), so the same script runs on any number of processes:

    python examples/stream_digits.py --out runs/stream
    unison launch --nproc 2 examples/stream_digits.py --out runs/stream2 --bs 32   # the same global batch

It prints `valid_accuracy` (the same on 1 and 2 processes: same global batches, same weights).
"""

import argparse
import math
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.distributed import num_distrib, rank0_first, rank_distrib


class ShardFiles(IterableDataset):
    """Yields `(image, label)` from each shard file in turn; holds one file in memory at a time."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __iter__(self):
        for file in self.files:
            x, y = torch.load(file, weights_only=True)
            yield from zip(x, y, strict=True)


def write_shards(folder: Path, x: torch.Tensor, y: torch.Tensor, per_file: int) -> list[Path]:
    """The shard files of `(x, y)`, written once (a second caller finds them)."""
    if (folder / "done").exists():
        return sorted(folder.glob("*.pt"))
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k, start in enumerate(range(0, len(x), per_file)):
        file = folder / f"shard-{k:03d}.pt"
        torch.save((x[start : start + per_file], y[start : start + per_file]), file)
        files.append(file)
    (folder / "done").touch()
    return files


parser = argparse.ArgumentParser(description="An MLP on a stream of digit shards with unison.")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--bs", type=int, default=64, help="batch size per process")
parser.add_argument("--out", type=Path, default=Path("."))
parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
args = parser.parse_args()
set_seed(42)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
n_valid = 360
# Rank 0 writes the files first; the other ranks then find them.
train = ShardFiles(rank0_first(write_shards, args.out / "train", x[:-n_valid], y[:-n_valid], per_file=200))
valid = ShardFiles(rank0_first(write_shards, args.out / "valid", x[-n_valid:], y[-n_valid:], per_file=200))
dls = DataLoaders(
    DataLoader(train, batch_size=args.bs, num_workers=args.workers),
    DataLoader(valid, batch_size=2 * args.bs),
)
# The stream has no len(): the one-cycle schedule is told the steps of an epoch (global batches).
steps = math.ceil((len(x) - n_valid) / (args.bs * num_distrib()))
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=[accuracy], path=args.out, steps_per_epoch=steps)
with learn.distrib_ctx():
    learn.fit_one_cycle(args.epochs, lr_max=1e-2)
    valid_loss, valid_accuracy = learn.validate()
if rank_distrib() == 0:
    print(f"valid_accuracy {valid_accuracy:.4f}")

"""A port of fastai's distributed examples (`nbs/examples/distrib*.py`) to unison, run as a module.

fastai's pattern, unchanged: prepare the data once with `rank0_first`, build a `Learner` with
one metric (`metrics=accuracy`), train inside `learn.distrib_ctx()`, save after it. The script
is a module, so it starts the way torchrun starts a module, and the same way without a launcher:

    torchrun --standalone --nproc-per-node 2 -m examples.fastai_distrib --bs 32
    unison launch --standalone --nproc-per-node 2 -m examples.fastai_distrib --bs 32
    python -m examples.fastai_distrib --bs 64       # one process at the same global batch

(from the repository root). Every rank prints `rank R weights H valid_acc A` at the end.
"""

import argparse
import hashlib
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.distributed import rank0_first, rank_distrib


def prepare(cache: Path) -> Path:
    """What fastai's `untar_data` does once per machine: make the data file (here from scikit-learn)."""
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        digits = load_digits()
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, x=digits.images.astype(np.float32) / 16, y=digits.target)
        tmp.replace(cache)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description="fastai-style distributed training on digits")
    parser.add_argument("--bs", type=int, default=32, help="batch size per process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=Path("fastai_distrib_out"))
    args = parser.parse_args()

    data = np.load(rank0_first(prepare, args.out / "digits.npz"))
    x, y = torch.from_numpy(data["x"]).unsqueeze(1), torch.from_numpy(data["y"]).long()
    n_train = 1536  # a multiple of every global batch used here: 2 x 32 = 64 = 1 x 64
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=args.bs, shuffle=True),
        DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=128),
    )
    set_seed(42)
    # No conv bias before BatchNorm, as fastai's ConvLayer (see the README's "What is exact").
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )  # fmt: skip
    learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=accuracy, path=args.out)
    with learn.distrib_ctx():
        learn.fit_one_cycle(args.epochs, args.lr)
        valid_acc = learn.validate()[1]
    learn.save("model")  # after the context, as fastai's examples do: rank 0 writes

    flat = torch.cat([v.detach().double().flatten() for v in learn.model.state_dict().values()])
    digest = hashlib.sha256(flat.float().numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank_distrib()} weights {digest} sum {flat.sum().item():.6f} valid_acc {valid_acc:.4f}")


if __name__ == "__main__":
    main()

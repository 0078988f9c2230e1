"""Your own training loop with unison: the digits CNN (BatchNorm, AdamW) of train_digits.py, written
as a plain PyTorch loop on `unison.Run` instead of a `Learner`.

    python examples/own_loop.py                                   # one process
    unison launch --nproc 2 examples/own_loop.py --bs 32          # two processes, the same global batch
    unison check-exact --nproc 2 --batch-arg bs examples/own_loop.py --bs 64   # 1 and 2 processes agree
    unison launch --nproc 2 --max-restarts 1 examples/own_loop.py --bs 32 --every 5   # resumes mid-epoch

It prints each epoch's exact training loss and the validation loss and accuracy over every
validation item once (on any number of processes), and writes `<out>/models/digits_own_loop.pth`.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison

parser = argparse.ArgumentParser(description="The digits CNN in an own loop on unison.Run.")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--bs", type=int, default=64, help="batch size per process")
parser.add_argument("--out", type=Path, default=Path("."))
parser.add_argument("--every", type=int, help="a checkpoint every N steps; a restarted run resumes from it")
args = parser.parse_args()
unison.set_seed(42)

# Data: 1797 grey 8x8 images (shipped with scikit-learn), a fixed 80/20 split.
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
x, y = x[order], y[order]
n_valid = len(x) // 5
train_dl = DataLoader(TensorDataset(x[:-n_valid], y[:-n_valid]), batch_size=args.bs, shuffle=True)
valid_dl = DataLoader(TensorDataset(x[-n_valid:], y[-n_valid:]), batch_size=2 * args.bs)


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)
    )


model = nn.Sequential(conv_block(1, 32), conv_block(32, 64), nn.Flatten(), nn.Linear(64 * 2 * 2, 10))
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

with unison.Run(path=args.out) as run:  # a plain run here, data-parallel under `unison launch`
    model, opt = run.setup(model, opt)  # BatchNorm synchronised exactly, DDP, this process's device
    train, valid = run.loader(train_dl), run.loader(valid_dl)
    if args.every:
        run.checkpoint(every=args.every)  # atomic; a preemption signal also writes one at once
    for epoch in run.epochs(args.epochs, resume=bool(args.every)):
        model.train()
        for xb, yb in train:
            loss = run.loss(F.cross_entropy(model(xb), yb, reduction="sum"), count=len(yb))
            run.backward(loss)
            opt.step()
            opt.zero_grad()
        model.eval()
        correct = total = 0.0
        with torch.no_grad():
            for xb, yb in valid:
                out = model(xb)
                run.loss(F.cross_entropy(out, yb, reduction="sum"), count=len(yb))  # recorder: valid_loss
                preds, targets = run.gather((out.argmax(1), yb))  # every item once, in order, on every rank
                correct += float((preds == targets).sum())
                total += len(targets)
        run.print(f"epoch {epoch} valid_accuracy {correct / total:.4f} ({int(total)} items)")
    train_loss, valid_loss = run.recorder.values[-1]
    run.print(f"train_loss {train_loss:.4f}")
    run.print(f"valid_loss {valid_loss:.4f}")
    run.print(f"valid_accuracy {correct / total:.4f}")
    if run.is_main:
        (args.out / "models").mkdir(parents=True, exist_ok=True)
        torch.save(run.model.state_dict(), args.out / "models" / "digits_own_loop.pth")

"""An Accelerate `no_trainer`-style evaluation on an odd-sized set, with `unison.Run`: 1,001 digits,
batch 16, run it on 2 processes. Every rank first trains the same small model (the same seed, the
same 796 other digits, on its own: nothing distributed), then the 1,001 items are evaluated
data-parallel two ways:

- unison: `run.loader` + `run.gather`: every item once, in data order;
- padded: torch's `DistributedSampler` (it pads 1,001 to 1,002 by repeating item 0) and a plain
  all-gather of each batch's predictions: what `accelerator.gather` reports, and what
  `gather_for_metrics` reports wherever it cannot trim the padding (it trims by the dataset's
  length, which an IterableDataset or a custom batch sampler does not give it).

    unison launch --nproc 2 examples/eval_no_trainer.py

Prints the one-process accuracy (rank 0, the whole set, no distribution), unison's, and the padded one.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import unison

N_EVAL, BS = 1001, 16
unison.set_seed(0)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
eval_ds, train_ds = TensorDataset(x[:N_EVAL], y[:N_EVAL]), TensorDataset(x[N_EVAL:], y[N_EVAL:])

# The same model on every rank: trained here on one process's data, a few epochs, no unison.
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
train_dl = DataLoader(train_ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
for _ in range(5):
    for xb, yb in train_dl:
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
model.eval()
with torch.no_grad():
    one_process = float((model(x[:N_EVAL]).argmax(1) == y[:N_EVAL]).float().mean())

with unison.Run() as run:
    model, _ = run.setup(model, opt)
    valid = run.loader(DataLoader(eval_ds, batch_size=BS), train=False)
    preds, labels = [], []
    with torch.no_grad():
        for xb, yb in valid:
            p, t = run.gather((model(xb).argmax(1), yb))
            preds.append(p)
            labels.append(t)
    preds, labels = torch.cat(preds), torch.cat(labels)
    unison_accuracy = float((preds == labels).float().mean())

    # The padded way, on the same model and data; and batch accuracies averaged (reduced before
    # the gather: the last, short batch weighs as much as a full one).
    padded_correct, padded_items, batch_means = 0.0, 0, []
    world = run.world_size
    sampler = DistributedSampler(eval_ds, num_replicas=world, rank=run.rank, shuffle=False)
    with torch.no_grad():
        for xb, yb in DataLoader(eval_ds, batch_size=BS, sampler=sampler):
            hits = (model(xb).argmax(1) == yb).float()
            batch_means.append(float(hits.mean()))
            if world > 1:
                gathered = [torch.empty_like(hits) for _ in range(world)]
                dist.all_gather(gathered, hits)
                hits = torch.cat(gathered)
            padded_correct += float(hits.sum())
            padded_items += len(hits)

    run.print(f"processes {world}; items {N_EVAL}; batch {BS}")
    run.print(f"one process: accuracy {one_process:.6f} over {N_EVAL} items")
    run.print(f"unison: accuracy {unison_accuracy:.6f} over {len(labels)} items")
    run.print(f"padded: accuracy {padded_correct / padded_items:.6f} over {padded_items} items")
    means = run.host.collective.gather_objects(batch_means)
    averaged = sum(sum(m) for m in means) / sum(len(m) for m in means)
    run.print(f"averaged per batch: accuracy {averaged:.6f}")
    same = unison_accuracy == one_process and torch.equal(labels, y[:N_EVAL])
    run.print(f"unison equals one process: {same}")

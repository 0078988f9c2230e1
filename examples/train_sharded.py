"""Sharded training (FSDP2): a small transformer learns whether a sequence contains token 7.

    python examples/train_sharded.py --out runs/sharded                  # one process
    unison launch --nproc 2 examples/train_sharded.py --out runs/sharded  # each rank holds half the weights

The same script resumes from its last checkpoint if it is run again (on any number of
processes at the same global batch), prints `valid_accuracy`, and exports the weights as
one plain state_dict file, `<out>/models/weights.pth`, for inference without unison.
"""

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Checkpoint, DataLoaders, Learner, accuracy, export_state_dict, set_seed
from unison.distributed import rank_distrib

parser = argparse.ArgumentParser(description="A small transformer trained sharded with unison.")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--bs", type=int, default=32, help="batch size per process")
parser.add_argument("--out", type=Path, default=Path("."))
args = parser.parse_args()
set_seed(0)

# Data: 1024 sequences of 8 tokens out of 16; the label says whether token 7 occurs.
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 16, (1024, 8), generator=g)
labels = (tokens == 7).any(1).long()
dls = DataLoaders(
    DataLoader(TensorDataset(tokens[:768], labels[:768]), batch_size=args.bs, shuffle=True),
    DataLoader(TensorDataset(tokens[768:], labels[768:]), batch_size=64),
)


class Classifier(nn.Module):
    def __init__(self, vocab=16, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


learn = Learner(
    dls,
    Classifier(),
    nn.CrossEntropyLoss(),
    lr=3e-3,
    metrics=[accuracy],
    path=args.out,
    cbs=[Checkpoint(every=10)],
)

# shard=True: each TransformerEncoderLayer (the repeated block) is sharded, then the rest.
with learn.distrib_ctx(shard=True):
    learn.fit_one_cycle(args.epochs, resume=True)  # continues from models/checkpoint.dcp if there is one
    valid_loss, valid_acc = learn.validate()

if rank_distrib() == 0:
    # From the last checkpoint (the sharded folder, or the plain file a single process wrote).
    weights = export_state_dict(learn.get_cb(Checkpoint).file, args.out / "models" / "weights.pth")
    plain = Classifier()
    plain.load_state_dict(torch.load(weights, weights_only=True))  # no unison, no process group needed
    same = all(
        torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), learn.model.state_dict().values(), strict=True)
    )
    print(f"valid_accuracy {valid_acc:.4f}")
    print(f"exported {weights} (equal to the trained model: {same})")

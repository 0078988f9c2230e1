"""A stock fastai script (fastai's own TabularDataLoaders, tabular_learner with BatchNorm, accuracy,
fit_one_cycle) trained data-parallel by unison with one added line: `with distrib_ctx(learn):`
(here with its checkpoint options: `--every N` checkpoints every N steps and resumes after a restart).

    python examples/fastai_bridge.py                                  # one process, plain fastai
    unison launch --nproc 2 examples/fastai_bridge.py                 # two processes, the same global batch
    unison check-exact --nproc 2 --float64 examples/fastai_bridge.py  # 1 and 2 processes agree
    unison launch --nproc 2 --max-restarts 1 examples/fastai_bridge.py --every 5   # a killed rank: resumed

The global batch is `--bs` (64); each process takes `bs // num_distrib()` of it, so any number
of processes trains to the weights of one. The data are generated here (no download): 1,000 rows
of a made-up table, 201 of them (an odd number) for validation. Rank 0 prints fastai's table and
writes `--out` (the final weights and the recorder's values) when given.
"""

import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from fastai.tabular.all import (
    Categorify,
    CategoryBlock,
    Normalize,
    TabularDataLoaders,
    accuracy,
    num_distrib,
    rank_distrib,
    set_seed,
    tabular_learner,
)

from unison.fastai import distrib_ctx


def make_table(n: int = 1000, seed: int = 0) -> pd.DataFrame:
    """A made-up table: two categories and three numbers decide a binary label."""
    rng = np.random.RandomState(seed)
    df = pd.DataFrame(
        {
            "colour": rng.choice(["red", "green", "blue"], n),
            "size": rng.choice(["S", "M", "L", "XL"], n),
            "a": rng.randn(n),
            "b": rng.randn(n) * 3 + 1,
            "c": rng.rand(n),
        }
    )
    score = df.a + 0.3 * df.b - 2 * df.c + (df.colour == "red") - 0.5 * (df["size"] == "XL")
    df["label"] = np.where(score + 0.3 * rng.randn(n) > 0, "yes", "no")
    return df


def build(bs: int, n: int = 1000, n_valid: int = 201):
    """fastai's DataLoaders and Learner, as any fastai script builds them (seeded first)."""
    set_seed(42)
    df = make_table(n)
    dls = TabularDataLoaders.from_df(
        df,
        procs=[Categorify, Normalize],
        cat_names=["colour", "size"],
        cont_names=["a", "b", "c"],
        y_names="label",
        y_block=CategoryBlock(),
        valid_idx=list(range(n - n_valid, n)),
        bs=bs,
    )
    # BatchNorm in every layer. The loss is torch's cross-entropy: fastai's CrossEntropyLossFlat
    # computes in float32 whatever the model's dtype (its TensorBase cast), which would hide
    # `check-exact --float64`'s losses behind float32 rounding (the weights agree either way).
    return tabular_learner(dls, layers=[32, 16], metrics=accuracy, loss_func=cross_entropy)


def cross_entropy(out, targ):
    """The mean cross-entropy of a batch (fastai's targets are int8 category codes)."""
    return F.cross_entropy(out, targ.long().view(-1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fastai's tabular_learner, data-parallel on unison.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--bs", type=int, default=64, help="the global batch size")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", help="write the final weights and recorded values here (rank 0)")
    parser.add_argument("--every", type=int, help="a checkpoint every N steps; a restarted job resumes")
    args = parser.parse_args()

    learn = build(args.bs // max(1, num_distrib()))
    with distrib_ctx(learn, checkpoint_every=args.every, resume=args.every is not None):  # the added line
        learn.fit_one_cycle(args.epochs, args.lr)
    if args.out and rank_distrib() == 0:
        state = {k: v.detach().cpu() for k, v in learn.model.state_dict().items()}
        torch.save(
            {"weights": state, "values": [list(map(float, v)) for v in learn.recorder.values]}, args.out
        )

"""A stock fastai tabular fit for the progress tests: 3 epochs of 25 training batches on each of 2 ranks.

400 training rows at a per-process batch of 8 (global 16 on 2 processes), 64 validation rows. Each
training batch sleeps `--sleep` seconds (0.02 by default) so that fastprogress redraws its bar many
times in an epoch. Rank 1 writes `RANK1 epoch K` on stderr after each epoch (its stdout is quiet
during a fit), so another rank's lines arrive while rank 0's bars are drawn.

    unison launch --nproc 2 tests/scripts/fastai_progress_script.py            # fit(3)
    unison launch --nproc 2 tests/scripts/fastai_progress_script.py --idioms   # fastai's switches:
        # fit(1) inside learn.no_logging(), fit(1) inside learn.no_bar(), then fit(1) as usual
    python tests/scripts/fastai_progress_script.py                             # one plain process
"""

import argparse
import sys
import time

import numpy as np
import pandas as pd
from fastai.tabular.all import (
    Callback,
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

N_TRAIN, N_VALID, GLOBAL_BS = 400, 64, 16


class Slow(Callback):
    """Sleeps after each training batch; rank 1 says when each epoch ends."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def after_batch(self) -> None:
        if self.training:
            time.sleep(self.sleep_s)

    def after_epoch(self) -> None:
        if rank_distrib() == 1:
            print(f"RANK1 epoch {self.epoch}", file=sys.stderr, flush=True)


def build(bs: int):
    """A tiny tabular Learner on made-up rows (two categories, two numbers, a binary label)."""
    set_seed(0)
    n = N_TRAIN + N_VALID
    rng = np.random.RandomState(0)
    df = pd.DataFrame(
        {"colour": rng.choice(["red", "blue"], n), "size": rng.choice(["S", "L"], n), "a": rng.randn(n)}
    )
    df["b"] = rng.randn(n)
    df["label"] = np.where(df.a + df.b + (df.colour == "red") > 0.5, "yes", "no")
    dls = TabularDataLoaders.from_df(
        df,
        procs=[Categorify, Normalize],
        cat_names=["colour", "size"],
        cont_names=["a", "b"],
        y_names="label",
        y_block=CategoryBlock(),
        valid_idx=list(range(N_TRAIN, n)),
        bs=bs,
    )
    return tabular_learner(dls, layers=[8], metrics=accuracy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument("--idioms", action="store_true", help="no_logging, no_bar, then a plain fit")
    args = parser.parse_args()

    learn = build(GLOBAL_BS // max(1, num_distrib()))
    learn.add_cb(Slow(args.sleep))
    with distrib_ctx(learn):
        if args.idioms:
            with learn.no_logging():
                learn.fit(1, 1e-2)
            with learn.no_bar():
                learn.fit(1, 1e-2)
            print("AFTER no_bar", flush=True)
            learn.fit(1, 1e-2)  # fastai put its own ProgressCallback back on leaving no_bar
        else:
            learn.fit(args.epochs, 1e-2)
    if rank_distrib() == 0:
        print("DONE", flush=True)

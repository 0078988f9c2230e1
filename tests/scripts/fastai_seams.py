"""Where a fastai user's own code meets the bridge, as fastai alone (`--plain`, one process at the
global batch) or on W processes: fastai's train metrics (`learn.recorder.train_metrics = True`, a
sklearn metric through `skm_to_fastai`, `RocAucBinary`), `fit_flat_cos` with `wd`, `fit_sgdr`,
`validate(dl=...)` and `get_preds(dl=..., act=..., reorder=False)` on a `test_dl`; with `--own-rows`,
each rank asks `get_preds` for its own rows (a loader that differs between ranks); with `--own-shard`,
each rank builds its DataLoaders from its own half of the table, as a torch script shards its files.

    python tests/scripts/fastai_seams.py --plain --out one
    python -m unison.launch --nproc 2 tests/scripts/fastai_seams.py --out two

Every rank writes `<out>.rank<R>.pt`: the recorder's rows, validate's values, the predictions and
the final weights.
"""

import argparse
import sys
from pathlib import Path

import torch
from fastai.tabular.all import (
    Callback,
    Categorify,
    CategoryBlock,
    Normalize,
    RocAucBinary,
    TabularDataLoaders,
    accuracy,
    set_seed,
    skm_to_fastai,
)
from sklearn.metrics import f1_score

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fastai_bridge import build, make_table  # noqa: E402  (the example's own DataLoaders and Learner)

from unison.fastai import num_distrib, rank_distrib  # noqa: E402  (and Learner.distrib_ctx)

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true", help="fastai alone, one process, no unison")
parser.add_argument("--out", required=True)
parser.add_argument("--own-rows", action="store_true", help="each rank predicts 40 rows of its own")
parser.add_argument("--own-shard", action="store_true", help="each rank's loaders hold its own half")
args = parser.parse_args()


class DoubleInputs(Callback):
    order = -4  # after the bridge trimmed and sharded the batch: the float64 model gets float64 inputs

    def before_batch(self) -> None:
        self.learn.xb = tuple(x.double() if x.is_floating_point() else x for x in self.learn.xb)

    def after_backward(self) -> None:
        self.learn.loss = self.learn.loss.float()  # (fastai's loss smoother is float32 whatever the model)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor (fastai's TensorBase is not among a weights-only load's types)."""
    return t.as_subclass(torch.Tensor).detach().clone()


torch.set_default_dtype(torch.float64)  # one process and W agree to float64 rounding
world, rank = (1, 0) if args.plain else (max(1, num_distrib()), rank_distrib())
out = Path(args.out)
learn = build(60 // world)
learn.model.double()
learn.add_cb(DoubleInputs())
learn.path = out.parent
learn.metrics = [accuracy, RocAucBinary(), skm_to_fastai(f1_score)]
learn.recorder.train_metrics = True  # fastai's metrics on the training batches too
table = make_table()
if args.own_shard:  # the same sizes and seed on every rank, other rows
    set_seed(42)
    shard = table.iloc[rank::world].reset_index(drop=True)
    learn.dls = TabularDataLoaders.from_df(
        shard,
        procs=[Categorify, Normalize],
        cat_names=["colour", "size"],
        cont_names=["a", "b", "c"],
        y_names="label",
        y_block=CategoryBlock(),
        valid_idx=list(range(400, 500)),
        bs=60 // world,
    )
with learn.no_bar(), learn.no_logging() if args.plain else learn.distrib_ctx():
    if args.own_rows:  # each rank's own 40 rows, as each would predict alone
        learn.get_preds(dl=learn.dls.test_dl(table.iloc[40 * rank : 40 * rank + 40]))
    learn.fit_flat_cos(2, 1e-2, wd=0.1)
    values = [[float(v) for v in row] for row in learn.recorder.values]
    test_dl = learn.dls.test_dl(table.iloc[:77])  # labelled: validate scores it
    validated = [float(v) for v in learn.validate(dl=test_dl)]
    preds, _ = learn.get_preds(dl=test_dl, act=torch.sigmoid, reorder=False)
    learn.fit_sgdr(2, 1, 1e-2)
    weights = {k.removeprefix("module."): v.detach().clone() for k, v in learn.model.state_dict().items()}
torch.save(
    {"values": values, "validated": validated, "preds": plain(preds), "weights": weights},
    f"{out}.rank{rank}.pt",
)

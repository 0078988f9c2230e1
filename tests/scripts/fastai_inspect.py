"""After a fit, what fastai users inspect and keep, inside the block, by fastai alone (`--plain`, one
process at the global batch) or on W processes: `get_preds(with_input=True)`,
`ClassificationInterpretation` (its items, top losses and confusion matrix), `learn.export` read back
with `load_learner`; and a `collab_learner(use_nn=True)` (its zero-width BatchNorm gets no gradient).
Every rank writes `<out>.rank<R>.pt`.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from fastai.collab import CollabDataLoaders, collab_learner
from fastai.interpret import ClassificationInterpretation
from fastai.learner import load_learner
from fastai.losses import CrossEntropyLossFlat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fastai_bridge import build  # noqa: E402  (the example's own DataLoaders and Learner)

from unison.fastai import num_distrib, rank_distrib  # noqa: E402  (and Learner.distrib_ctx)

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

world = 1 if args.plain else max(1, num_distrib())
out = Path(args.out)
learn = build(60 // world)
learn.path = out.parent
learn.loss_func = CrossEntropyLossFlat()  # (ClassificationInterpretation asks it for per-item losses)
ratings = pd.DataFrame(
    {
        "user": np.random.RandomState(1).randint(0, 30, 600),
        "item": np.random.RandomState(2).randint(0, 20, 600),
        "rating": np.random.RandomState(3).rand(600) * 5,
    }
)
torch.manual_seed(0)
collab = collab_learner(
    CollabDataLoaders.from_df(ratings, bs=60 // world, seed=5), use_nn=True, layers=[8], y_range=(0, 5.5)
)
results = {}


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor (fastai's TensorBase is not among a weights-only load's types)."""
    return t.as_subclass(torch.Tensor).detach().clone()


with learn.no_bar(), collab.no_bar():
    with learn.no_logging() if args.plain else learn.distrib_ctx():
        learn.fit(1, 1e-2)
        inputs, preds, targs = learn.get_preds(with_input=True)
        interp = ClassificationInterpretation.from_learner(learn)
        item = interp[[0, 1, 200]]  # inputs, preds, targs, decoded, losses of three items
        top_losses, top_idx = interp.top_losses(5)
        learn.export("exported.pkl")  # rank 0 writes; every rank reads it back below
        reloaded = load_learner(out.parent / "exported.pkl")
        results.update(
            inputs=[plain(t) for t in inputs],
            preds=plain(preds),
            targs=plain(targs),
            item_losses=plain(item[4]),
            top_losses=plain(top_losses),
            top_idx=plain(top_idx),
            confusion=torch.as_tensor(interp.confusion_matrix()),
            reloaded=[
                float((p.detach() - q.detach()).abs().max())
                for p, q in zip(reloaded.model.parameters(), learn.model.parameters(), strict=True)
            ],
        )
    with collab.no_logging() if args.plain else collab.distrib_ctx():
        collab.fit(1, 1e-2)
results["collab"] = {k: v.detach().clone() for k, v in collab.model.state_dict().items()}
torch.save(results, f"{out}.rank{rank_distrib()}.pt")

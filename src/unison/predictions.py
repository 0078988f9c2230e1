"""What `Learner.get_preds` and `Learner.predict` need: collect outputs batch by batch, then join
them in their own structure and put them back in dataset order across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from unison.callbacks.core import Callback
from unison.data.batch import cat_structured, map_tensors

if TYPE_CHECKING:
    from unison.distributed.collective import Collective


class PredsCollector(Callback):
    """Keeps each batch's outputs and targets (real rows only: padding never reaches the model
    or is trimmed before this runs). Runs at `after_pred`, so it needs no loss or targets."""

    order = 100

    def __init__(self) -> None:
        self.preds: list[Any] = []
        self.targets: list[Any] = []

    def after_pred(self) -> None:
        learn = self.learn
        if learn.training:
            return
        self.preds.append(map_tensors(Tensor.detach, learn.pred))
        if learn.yb:
            self.targets.append(map_tensors(Tensor.detach, learn.yb[0]))

    def gathered(self, collective: Collective, pad_value: float) -> tuple[Any, Any]:
        """`(preds, targets)` of every rank, each leaf in dataset order, in the outputs' own structure."""

        def combine(t: Tensor) -> Tensor:
            return collective.gather_ordered(t, pad_value=pad_value)

        preds = cat_structured(self.preds, pad_value, combine)
        # Every rank must agree on whether there are targets: an unlabelled loader has none anywhere.
        has_targets = bool(self.targets) and len(self.targets) == len(self.preds)
        targets = cat_structured(self.targets, pad_value, combine) if has_targets else None
        return preds, targets


def first_row(out: Any) -> Any:
    """The single sample of a batch of one, in the output's own structure."""
    return map_tensors(lambda t: t[0] if t.dim() else t, out)

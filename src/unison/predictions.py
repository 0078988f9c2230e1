"""What `Learner.get_preds` and `Learner.predict` need: collect outputs batch by batch, then join
them in their own structure and put them back in dataset order across ranks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unison.data.batch import cat_structured, map_tensors, split_batch, to_device
from unison.events import Callback

if TYPE_CHECKING:
    from unison.distributed.collective import Collective


class PredsCollector(Callback):
    """Keeps each batch's outputs and targets (real rows only: padding never reaches the model
    or is trimmed before this runs). Runs at `after_pred`, so it needs no loss or targets."""

    order = 100

    def __init__(self, with_loss: bool = False) -> None:
        self.preds: list[Any] = []
        self.targets: list[Any] = []
        self.with_loss = with_loss
        self.losses: list[Tensor] = []

    def after_pred(self) -> None:
        learn = self.learn
        if learn.training:
            return
        self.preds.append(map_tensors(Tensor.detach, learn.pred))
        if learn.yb:
            self.targets.append(map_tensors(Tensor.detach, learn.yb[0]))
        if self.with_loss:
            self.losses.append(per_item_loss(learn.loss_func, learn.pred, *learn.yb).detach())

    def gathered(self, collective: Collective, pad_value: float) -> tuple[Any, ...]:
        """`(preds, targets)` of every rank, each leaf in dataset order, in the outputs' own structure."""
        combine = functools.partial(collective.gather_ordered, pad_value=pad_value)
        preds = cat_structured(self.preds, pad_value, combine)
        # Every rank must agree on whether there are targets: an unlabelled loader has none anywhere.
        has_targets = bool(self.targets) and len(self.targets) == len(self.preds)
        targets = cat_structured(self.targets, pad_value, combine) if has_targets else None
        if self.with_loss:
            return preds, targets, cat_structured(self.losses, pad_value, combine)
        return preds, targets


def collect_preds(
    learn: Any, run_pass: Callable[[], None], with_loss: bool, pad_value: float
) -> tuple[Any, ...]:
    """`Learner.get_preds`: run an evaluation pass (`run_pass`) with no loss and no metric, keeping
    every rank's outputs (and per-item losses with `with_loss`), then gather them in data order."""
    if with_loss:
        check_per_item_loss(learn.loss_func)
    collector = PredsCollector(with_loss)
    learn.record_metrics, learn.score = False, False
    last_valid = learn.recorder.last_valid
    try:
        with learn.added_cbs([collector]):
            run_pass()
    finally:
        learn.record_metrics, learn.score = True, True
        learn.recorder.last_valid = last_valid  # get_preds is not a validation: keep its values
    return collector.gathered(learn.collective, pad_value)


def check_per_item_loss(loss_func: Any) -> None:
    """Refuse, before any batch runs, a loss that cannot give one value per item."""
    if loss_func is None or not hasattr(loss_func, "reduction"):
        raise ValueError(
            "get_preds(with_loss=True) needs a loss_func with a `reduction` attribute (torch's losses, "
            f"e.g. nn.CrossEntropyLoss()) to compute one loss per item; got {loss_func!r}"
        )


def per_item_loss(loss_func: Any, pred: Any, *targets: Any) -> Tensor:
    """`loss_func` unreduced (one value per item, or per token), through its `reduction` attribute
    as torch's losses have it (`nn.CrossEntropyLoss()`: a module, typed Any for that attribute;
    `collect_preds` checked that it has one)."""
    saved = loss_func.reduction
    loss_func.reduction = "none"
    try:
        return loss_func(pred, *targets)
    finally:
        loss_func.reduction = saved


def predict_item(
    model: Any, collate: Callable[[list[Any]], Any], item: Any, batched: bool, n_inp: int, call_model: Any
) -> Any:
    """`Learner.predict`: the model's output for one item (collated by `collate`) or a small batch,
    on this process, in eval mode, without gradients; the model's mode is put back after."""
    batch = item if batched else collate([item])
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    xb, _ = split_batch(to_device(batch, device), n_inp)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = call_model(model, xb)
    finally:
        model.train(was_training)
    # One item: the single sample of the batch of one, in the output's own structure.
    return out if batched else map_tensors(lambda t: t[0] if t.dim() else t, out)

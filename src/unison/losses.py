"""Losses that stay exact over any number of processes: a sum and a count, not a mean.

A loss function may return `SummedLoss(total, count)` instead of a mean: the sum of a
per-token (or per-anything) loss over the batch and how many terms it holds. The
learner then divides the gradient by the *global* count, over every rank and every
gradient-accumulation micro-step, so W processes train exactly like one on the whole
global batch, and validation reports `sum / count` over the whole set. A plain mean
loss is read as `SummedLoss(mean * batch_size, batch_size)`.

>>> loss_func = TokenCrossEntropy(shift=True)   # a causal LM's next-token loss
>>> Learner(dls, gpt2, loss_func)                # doctest: +SKIP

With `loss_func=None` the loss is the model's own (`out.loss` or `out["loss"]`); for a
dict batch with Hugging Face `labels` it is made exact the same way, the count being
the labels that are not -100 (shifted by one for a causal LM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's "not a target"


class SummedLoss(NamedTuple):
    """A batch's loss as `(total, count)`: what a loss function returns to be exact across ranks.

    >>> def token_loss(logits, labels):
    ...     total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ...     return SummedLoss(total, (labels != -100).sum())
    """

    total: Tensor
    count: Tensor | int | float


class TokenCrossEntropy:
    """Cross-entropy summed over the tokens whose label is not `ignore_index`, as a `SummedLoss`.

    `shift=True` scores position t against the label at t + 1 (a causal LM's labels are its inputs).

    >>> TokenCrossEntropy()(torch.zeros(1, 3, 5), torch.tensor([[1, 2, -100]])).count
    tensor(2)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, shift: bool = False):
        self.ignore_index, self.shift = ignore_index, shift

    def __call__(self, pred: Any, labels: Tensor) -> SummedLoss:
        logits = own_field(pred, "logits") if not isinstance(pred, Tensor) else pred
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return SummedLoss(total, (labels != self.ignore_index).sum())


def own_field(out: Any, name: str) -> Any:
    """`out.name` or `out["name"]`: a field of a model's output (dict, `ModelOutput`, object)."""
    if isinstance(out, Mapping) and name in out:
        return out[name]
    value = getattr(out, name, None)
    if value is None:
        raise ValueError(
            f"the model's output ({type(out).__name__}) has no {name!r}: with loss_func=None the model "
            "must return its own loss (out.loss or out['loss']); otherwise pass a loss_func"
        )
    return value


def _is_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def label_count(model: nn.Module, labels: Tensor) -> int:
    """How many terms a Hugging Face model's mean loss averaged: labels that are not -100,
    without the first position for a causal LM (it predicts each token from those before).

    >>> label_count(bert_classifier, torch.tensor([1, 0, -100]))   # doctest: +SKIP
    2
    """
    if labels.dim() >= 2 and _is_causal_lm(model):
        labels = labels[..., 1:]
    if labels.is_floating_point():
        return labels.numel()
    return int((labels != IGNORE_INDEX).sum())


def zero_loss(pred: Any) -> Tensor:
    """0, connected to every float output that needs a gradient: a backward pass that adds
    nothing but still runs every gradient hook (a rank whose share of a batch is empty)."""
    from unison.data.batch import tensors_in

    parts = [t.float().sum() for t in tensors_in(pred) if t.requires_grad and t.dim()]
    return (sum(parts) * 0.0) if parts else torch.zeros(())

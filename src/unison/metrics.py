"""Metrics that are exact on one process or many.

A metric keeps *state*, not per-batch averages: tensors that add up across batches
(`sum` states) or per-sample values kept in data order (`cat` states). Across ranks
the learner reduces that state (all-reduce for sums, an ordered gather for
concatenations) and only then computes the value, so N processes give the value
one process gives.

Two kinds cover most needs:

- `AvgMetric(func)`: `func(pred, target)` returns a batch mean (e.g. `accuracy`);
  the metric is the mean over samples. Any such plain function passed in
  `Learner(metrics=...)` is wrapped this way.
- `AccumMetric(func)`: `func(all_preds, all_targets)` needs every prediction at
  once (AUC, F1, ...).

To write a new one, subclass `Metric`, declare its state and implement `update`
and `compute`:

>>> class ErrorCount(Metric):
...     sum_states = ("wrong",)
...     def update(self, pred, target):
...         self.wrong = self.wrong + (pred.argmax(-1) != target).sum()
...     def compute(self):
...         return float(self.wrong)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from unison.distributed.collective import Collective


def batch_size_of(batch: Any) -> int:
    """Number of samples in a (nested) batch: dim 0 of its first tensor."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    for item in batch:
        return batch_size_of(item)
    return 0


class Metric:
    """Base class. `sum_states` start at 0 and are summed over ranks; `cat_states`
    collect per-sample tensors, concatenated in data order."""

    sum_states: tuple[str, ...] = ()
    cat_states: tuple[str, ...] = ()

    def __init__(self, name: str | None = None):
        self._name = name
        self.reset()

    @property
    def name(self) -> str:
        return self._name or type(self).__name__.lower()

    def reset(self) -> None:
        for state in self.sum_states:
            setattr(self, state, torch.zeros(()))
        for state in self.cat_states:
            setattr(self, state, [])

    def update(self, pred: Any, *targets: Any) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError

    def sync(self, collective: Collective) -> None:
        """Turn this rank's state into the state of all ranks together."""
        for state in self.sum_states:
            setattr(self, state, collective.sum(getattr(self, state)))
        for state in self.cat_states:
            parts: list[Tensor] = getattr(self, state)
            local = torch.cat(parts) if parts else torch.zeros(0)
            setattr(self, state, [collective.gather_ordered(local)])

    def value(self, collective: Collective) -> float:
        """Synchronise, then compute."""
        self.sync(collective)
        out = self.compute()
        return float(out.item()) if isinstance(out, Tensor) else float(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class WeightedMean(Metric):
    """Mean of values added with weights (`add(value, n)`): a loss over samples, say."""

    sum_states = ("total", "count")

    def add(self, value: Tensor | float, n: int) -> None:
        if n == 0:
            return
        value = torch.as_tensor(value).detach().float()
        self.total = self.total.to(value.device) + value * n
        self.count = self.count.to(value.device) + n

    def update(self, pred: Any, *targets: Any) -> None:
        raise TypeError(f"{type(self).__name__} takes values through add(value, n)")

    def compute(self) -> float:
        return float(self.total / self.count) if self.count > 0 else float("nan")


class AvgMetric(WeightedMean):
    """Mean over samples of `func(pred, *targets)`, which returns the mean over a batch.

    >>> learn = Learner(dls, model, loss_func, metrics=[AvgMetric(accuracy)])
    """

    def __init__(self, func: Callable[..., Tensor | float], name: str | None = None):
        if not callable(func):
            raise TypeError(f"AvgMetric needs a callable, got {func!r}")
        self.func = func
        super().__init__(name or getattr(func, "__name__", type(func).__name__))

    def update(self, pred: Any, *targets: Any) -> None:
        n = batch_size_of(targets) if targets else batch_size_of(pred)
        if n:
            self.add(self.func(pred, *targets), n)


class AccumMetric(Metric):
    """`func(preds, targets)` over every prediction at once (AUC, F1, ...).

    `activation` is applied to the model's outputs first, e.g. `torch.sigmoid`.

    >>> auc = AccumMetric(roc_auc, activation=lambda p: p.softmax(-1)[:, 1])
    """

    cat_states = ("preds", "targets")

    def __init__(
        self,
        func: Callable[[Tensor, Tensor], Tensor | float],
        name: str | None = None,
        activation: Callable[[Tensor], Tensor] | None = None,
    ):
        if not callable(func):
            raise TypeError(f"AccumMetric needs a callable, got {func!r}")
        self.func = func
        self.activation = activation
        super().__init__(name or getattr(func, "__name__", type(func).__name__))

    def update(self, pred: Tensor, *targets: Tensor) -> None:
        pred = pred.detach()
        if self.activation is not None:
            pred = self.activation(pred)
        self.preds.append(pred)
        self.targets.append(targets[0].detach())

    def compute(self) -> float:
        preds = torch.cat(self.preds) if self.preds else torch.zeros(0)
        targets = torch.cat(self.targets) if self.targets else torch.zeros(0)
        out = self.func(preds, targets)
        return float(out)


def as_metric(m: Metric | Callable[..., Any]) -> Metric:
    """A `Metric` as given, a plain function wrapped in `AvgMetric`; anything else is an error."""
    if isinstance(m, Metric):
        return m
    if isinstance(m, type) and issubclass(m, Metric):
        return m()
    if callable(m):
        return AvgMetric(m)
    raise TypeError(f"metric {m!r} is neither a unison Metric nor a callable(pred, target)")


def accuracy(pred: Tensor, target: Tensor, axis: int = -1) -> Tensor:
    """Fraction of samples whose arg-max prediction equals the target.

    >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    tensor(0.5000)
    """
    return (pred.argmax(dim=axis) == target).float().mean()


def error_rate(pred: Tensor, target: Tensor, axis: int = -1) -> Tensor:
    """1 - accuracy."""
    return 1 - accuracy(pred, target, axis)


def roc_auc(scores: Tensor, target: Tensor) -> float:
    """Area under the ROC curve of binary `target` given `scores` (ties count one half).

    It needs every score at once: use it through `AccumMetric`.

    >>> roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    0.75
    """
    scores = scores.reshape(-1).double()
    target = target.reshape(-1).bool()
    n_pos, n_neg = int(target.sum()), int((~target).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Mann-Whitney U with average ranks for ties.
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    uniq, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2
    ranks[order] = avg_rank[inverse]
    u = ranks[target].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))

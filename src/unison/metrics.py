"""Metrics that are exact on one process or many.

A metric keeps *state*, not per-batch averages: tensors that add up across batches
(`sum` states) or per-sample values kept in data order (`cat` states). Across ranks
the learner reduces that state (all-reduce for sums, an ordered gather for
concatenations) and only then computes the value, so N processes give the value
one process gives.

Two kinds cover most needs:

- `AvgMetric(func)`: `func(pred, target)` returns a batch mean (e.g. `accuracy`);
  the metric is the mean over samples, each batch weighted by its size. Any plain
  function passed in `Learner(metrics=...)` is wrapped this way, which is exact only
  for a per-sample mean; a function whose name says it is not one (F1, AUC,
  precision, recall, MCC, R2, ...) is refused with a pointer to `AccumMetric`.
- `AccumMetric(func)`: `func(all_preds, all_targets)` needs every prediction at
  once (AUC, F1, ...). Variable-length outputs are joined padded with -100.
- A `torchmetrics.Metric` (or `MetricCollection`) is accepted as it is: updated with
  real items only, its state synchronised over the learner's process group by
  torchmetrics' own `sync`, then computed.

A model output with `logits` (a dict or `ModelOutput`) reaches metrics as its logits.

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

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from unison.data.batch import batch_size_of, cat_padded
from unison.losses import describe_output, output_logits

if TYPE_CHECKING:
    from unison.distributed.collective import Collective


def metric_input(pred: Any) -> Any:
    """What a metric scores, by the rule of `unison.losses.output_logits`: a tensor itself, a
    dict's or `ModelOutput`'s `logits`, a `(loss, logits, ...)` tuple's logits; any other output
    (a dict without logits, a tuple of outputs) is given whole to a metric that knows it.

    >>> metric_input({"loss": torch.tensor(0.5), "logits": torch.ones(2, 3)}).shape
    torch.Size([2, 3])
    """
    try:
        return output_logits(pred)
    except ValueError:
        return pred


def update_metric(metric: Metric, pred: Any, *targets: Any) -> None:
    """`metric.update` on `metric_input(pred)`; a metric that cannot read that structure is
    refused naming it, instead of an AttributeError deep in its code."""
    scored = metric_input(pred)
    try:
        metric.update(scored, *targets)
    except (AttributeError, TypeError) as e:
        if isinstance(scored, Tensor):
            raise
        raise ValueError(
            f"metric {metric.name!r} cannot score the model's output ({describe_output(pred)}): metrics get "
            "a tensor output, the 'logits' of a dict or ModelOutput, or the logits of a (loss, logits, ...) "
            f"tuple; return one of those or give a metric that reads this structure ({e})"
        ) from e


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
            local = cat_padded(getattr(self, state))  # empty where this rank saw no item (a tiny set)
            if collective.active:
                local = _shaped_like_others(collective, local)
            setattr(self, state, [collective.gather_ordered(local, pad_value=-100)])

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
    total: Tensor  # set by reset()
    count: Tensor

    def add(self, value: Tensor | float, n: float) -> None:
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

    For example:

        learn = Learner(dls, model, loss_func, metrics=[AvgMetric(accuracy)])
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
    preds: list[Tensor]  # set by reset()
    targets: list[Tensor]

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
        self.preds.append(_activated(pred, self.activation))
        self.targets.append(targets[0].detach())

    def compute(self) -> float:
        return float(self.func(cat_padded(self.preds), cat_padded(self.targets)))


class TorchMetric(Metric):
    """A `torchmetrics.Metric` inside the learner (a `MetricCollection` gives one each): updated on real items
    only, synchronised over the learner's group with torchmetrics' own `sync`, then computed.

        from torchmetrics.classification import MulticlassF1Score
        learn = Learner(dls, model, loss_func, metrics=[MulticlassF1Score(3, average="macro")])
    """

    def __init__(
        self, metric: Any, name: str | None = None, activation: Callable[[Tensor], Tensor] | None = None
    ):
        self.metric = metric
        self.activation = activation
        # unison decides when to sync (over its own group), never torchmetrics behind its back.
        self.metric.sync_on_compute = False
        self.metric._to_sync = False  # what compute() reads (torchmetrics copies it at init)
        super().__init__(name or _snake(type(metric).__name__))

    def reset(self) -> None:
        self.metric.reset()

    def update(self, pred: Any, *targets: Any) -> None:
        pred = _activated(pred, self.activation)
        if self.metric.device != pred.device:
            self.metric.to(pred.device)
        self.metric.update(pred, *(t.detach() for t in targets))

    def sync(self, collective: Collective) -> None:
        if collective.active:
            self.metric.sync(
                dist_sync_fn=_gather_fn(collective),
                process_group=collective.group,
                should_sync=True,
                distributed_available=lambda: True,
            )

    def compute(self) -> float:
        out = self.metric.compute()
        return float(out.float().mean()) if isinstance(out, Tensor) else float(out)

    def value(self, collective: Collective) -> float:
        try:
            return super().value(collective)
        finally:
            if getattr(self.metric, "_is_synced", False):  # compute() may have restored it already
                self.metric.unsync()


def _activated(pred: Tensor, activation: Callable[[Tensor], Tensor] | None) -> Tensor:
    """`pred` detached, then through `activation` (`AccumMetric`'s and `TorchMetric`'s option) when given."""
    pred = pred.detach()
    return pred if activation is None else activation(pred)


def _shaped_like_others(collective: Collective, t: Tensor) -> Tensor:
    """`t`; where it is empty (a rank that saw no item, its state an empty 1-D tensor), an empty tensor
    with another rank's trailing dims and dtype, so that every rank gathers alike (a collective)."""
    kinds = collective.gather_objects((tuple(t.shape), t.dtype))
    filled = [(shape, dtype) for shape, dtype in kinds if shape and shape[0] > 0]
    if t.numel() == 0 and filled:
        shape, dtype = filled[0]
        return torch.zeros((0, *shape[1:]), dtype=dtype, device=t.device)
    return t


def _gather_fn(collective: Collective) -> Callable[..., list[Tensor]]:
    """torchmetrics' `gather_all_tensors`, each rank's state first `_shaped_like_others`."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    def gather(t: Tensor, group: Any = None) -> list[Tensor]:
        return gather_all_tensors(_shaped_like_others(collective, t), group=group)

    return gather


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _is_torchmetric(m: Any) -> bool:
    return any(
        c.__module__.startswith("torchmetrics") for c in type(m).__mro__ if c is not object
    ) and hasattr(m, "update")


# A plain function is averaged over batches; these names say that would be wrong.
_NOT_A_MEAN = re.compile(r"f1|f_?beta|auc|auroc|roc|precision|recall|matthews|mcc|r2|kappa|corr", re.I)


def as_metric(m: Metric | Callable[..., Any]) -> Metric:
    """A `Metric` as given, a torchmetrics metric adapted, a plain per-sample-mean function wrapped
    in `AvgMetric`; a function that cannot be averaged over batches, or anything else, is an error."""
    if isinstance(m, Metric):
        return m
    if isinstance(m, type) and issubclass(m, Metric):
        return m()
    if _is_torchmetric(m):
        return TorchMetric(m)
    if callable(m):
        name = getattr(m, "__name__", type(m).__name__)
        if _NOT_A_MEAN.search(name):
            raise ValueError(
                f"metric {name!r} is not a mean over samples, so averaging it over batches would be wrong: "
                f"pass AccumMetric({name}) (computed once over every prediction) or a torchmetrics Metric"
            )
        return AvgMetric(cast(Callable[..., Any], m))
    raise TypeError(f"metric {m!r} is neither a unison Metric nor a callable(pred, target)")


def as_metrics(metrics: Iterable[Any] | Any) -> list[Metric]:
    """`Learner(metrics=...)`: a single metric or function, or an iterable of them."""
    if isinstance(metrics, Metric) or callable(metrics) or _is_torchmetric(metrics):
        metrics = [metrics]
    out: list[Metric] = []
    for m in metrics:
        if _is_torchmetric(m) and hasattr(m, "items"):  # a MetricCollection: one column per metric
            out += [TorchMetric(v, name=k) for k, v in m.items()]
        else:
            out.append(as_metric(m))
    return out


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
    uniq, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2
    ranks[order] = avg_rank[inverse]
    u = ranks[target].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))

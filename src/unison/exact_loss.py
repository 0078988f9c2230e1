"""How the learner reads each batch's loss and divides each optimizer step's gradient exactly.

Every loss is read as a sum and a count (`SummedLoss`): a mean loss is its mean times
its rows, a model's own Hugging Face loss its mean times the labels it scored. Each
micro-batch backpropagates `sum / ref`, `ref` a constant the same on every rank (the
loader's batch size); at the step the gradient, already averaged over ranks by DDP or
FSDP, is multiplied by `ref * W / N`, N the count over every rank and micro-batch. So W
processes, and gradient accumulation, give one process's gradient on the global batch.
For full batches of a mean loss the factor is exactly 1 and no gradient is touched;
when the count is the batches' rows, N comes from the loader's plan, without a collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from unison.data.batch import batch_size_of, map_tensors
from unison.data.ranked import is_rank_sharded
from unison.losses import (
    SummedLoss,
    TokenCrossEntropy,
    count_by_rule,
    model_loss,
    nll_module,
    output_logits,
    own_count,
    own_loss_rule,
    sums_over_rows,
    uncounted_mean,
    weighted_count,
    zero_loss,
)

if TYPE_CHECKING:
    from unison.distributed.collective import Collective
    from unison.learner_view import EngineHost


def takes_targets(func: Callable[..., Any] | None) -> bool:
    """Whether a loss function accepts a second positional argument (targets); `lambda out:
    out.loss`, for a model that scores itself, does not."""
    if func is None:
        return True
    try:
        kinds = [p.kind for p in inspect.signature(func).parameters.values()]
    except (TypeError, ValueError):
        return True
    P = inspect.Parameter
    positional = sum(k in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) for k in kinds)
    return positional > 1 or P.VAR_POSITIONAL in kinds


class StepCount:
    """The loss terms of the optimizer step in progress (see the module's docstring)."""

    def __init__(self, ref: float = 1.0) -> None:
        self.ref = ref
        self.local = 0.0
        self.known: float | None = 0.0  # the global count, while the loader's plan tells it (rows)
        self._summing: Callable[[], Tensor] | None = None  # the step's count, being summed over ranks

    def add(
        self,
        count: float,
        global_count: float | None,
        last: bool = False,
        collective: Collective | None = None,
    ) -> float:
        """Count a micro-batch's loss terms; at the step's `last` one, an unknown global count starts
        being summed over the ranks of `collective` now, so that the sum travels during the backward
        pass instead of after it (`benchmarks/step_count_overlap.py` measures both)."""
        self.local += count
        self.known = None if self.known is None or global_count is None else self.known + global_count
        self._summing = None  # (a step redone after a failure counts afresh)
        if last and self.known is None and collective is not None and collective.active:
            self._summing = collective.start_sum(torch.tensor([self.local], dtype=torch.float64))
        return self.ref

    def factor(self, collective: Collective) -> float:
        ref, total, known, summing = self.ref, self.local, self.known, self._summing
        self.local, self.known, self._summing = 0.0, 0.0, None
        if known is not None:
            total = known  # every rank's rows are in the plan: no collective needed
        elif summing is not None:
            total = float(summing()[0])
        elif collective.active:
            total = float(collective.sum(torch.tensor([total], dtype=torch.float64))[0])
        return ref * collective.world_size / total if total > 0 else 0.0


class ExactLoss:
    """The learner's loss reader and gradient divider.

    For example:

        exact = ExactLoss()
        total, count, mean = exact.terms(learn)
        learn.loss_grad = exact.to_backward(learn, total, count, mean)
    """

    def __init__(self) -> None:
        self.step = StepCount()
        # Whether the count is the batch's rows: every rank must take the same view (it decides
        # whether a collective runs), so an empty share keeps the view of the rank's last batch.
        self.count_is_rows: bool | None = None
        self._func: Any = object()
        self._takes_targets = True
        self._own_rule: str | None = None  # which labels the model's own loss scored (losses.py)
        self._own_rule_for: Any = None  # the loader of the pass that rule was read on
        self._read_for: Any = None  # the loader of the pass whose targets `uncounted_mean` last read

    def start_epoch(self, batch_size: int | None) -> None:
        self.step = StepCount(float(batch_size or 1))

    def terms(self, learn: EngineHost) -> tuple[Tensor, float, Tensor | None]:
        """`(sum, count, mean)` of this batch's loss (`mean` None when only the sum is known)."""
        func = learn.loss_func
        if self.count_is_rows is None:  # before any batch: judged from the loss alone
            self.count_is_rows = func is not None and not isinstance(func, TokenCrossEntropy)
        if learn._empty_share:  # no rows: a backward pass that adds nothing but runs every hook
            return zero_loss(learn.pred), 0.0, None
        if func is None:
            return self._own_terms(learn)
        if func is not self._func:  # the loss may be swapped between fits
            self._func, self._takes_targets = func, takes_targets(func)
        out = self._call(func, learn.pred, learn.yb)
        if isinstance(out, SummedLoss):
            self.count_is_rows = False
            count = out.count
            return out.total, float(count.item() if isinstance(count, Tensor) else count), None
        if learn.training and isinstance(out, Tensor) and out.dim() > 0:  # (evaluation: fastai's with_loss)
            raise ValueError(
                f"loss_func returned a tensor of shape {tuple(out.shape)}, not one loss: reduce it "
                '(reduction="mean"), or return SummedLoss(losses.sum(), count=...) for per-item losses'
            )
        targets = learn.yb[0] if learn.yb else None
        module = nll_module(func)
        if (
            module is not None
            and module.weight is not None
            and isinstance(targets, Tensor)
            and not targets.is_floating_point()
        ):
            self.count_is_rows = False  # a class-weighted mean: over its targets' weights
            weights = weighted_count(module, targets)
            if not float(weights):  # every target ignored: the mean is 0/0, the share adds nothing
                return zero_loss(learn.pred), 0.0, None
            return out * weights, float(weights), out
        # Reading the targets waits for the device: on a GPU only each pass's first batch is read.
        on_device = isinstance(targets, Tensor) and targets.device.type != "cpu"
        why, first_batch = None, self._read_for is not learn.dl
        n = float(batch_size_of(learn.yb) if learn.yb else batch_size_of(learn.xb))
        if not on_device or first_batch:
            recorded = self._with_graph(func, out, learn.pred, learn.yb)
            if sums_over_rows(func, recorded):
                raise ValueError(
                    "loss_func sums over the batch's rows: each rank would sum its share and DDP average "
                    "the shares, 1/W of one process's gradient; use reduction=\"mean\" (the global batch's "
                    "mean, exact on any W: scale the learning rate by the batch size to keep a sum's steps) "
                    "or return SummedLoss(loss_sum, count=n)"
                )
            why = uncounted_mean(func, recorded, targets)
            # A divisor is read at a pass's first batch only: a constant one (`sum / bs`) meets the short
            # last batch, where dividing by the batch size is what the plain loop does too.
            if why is None and first_batch:
                why = own_count(recorded, int(n))
        self._read_for = learn.dl
        if why is not None:
            raise ValueError(
                f"loss_func {why}: its mean is not over the batch's rows, so W processes would weigh each "
                "rank's mean by its rows: use nn.CrossEntropyLoss(weight=...) (counted by its weights), "
                "unison.TokenCrossEntropy(ignore_index=...) (by its scored targets) or return a SummedLoss"
            )
        self.count_is_rows = True
        return out * n, n, out

    def _call(self, func: Callable[..., Any], pred: Any, yb: tuple[Any, ...]) -> Any:
        return func(pred, *yb) if self._takes_targets else func(pred)

    def _with_graph(self, func: Callable[..., Any], out: Tensor, pred: Any, yb: tuple[Any, ...]) -> Tensor:
        """`out`, or where torch recorded no graph for it (evaluation) and it may be a cross-entropy
        (integer targets), the loss computed again on a copy of the output that records one:
        `uncounted_mean` reads class weights and ignored targets from that graph."""
        targets = yb[0] if yb else None
        if out.grad_fn is not None or nll_module(func) is not None:
            return out
        if not isinstance(targets, Tensor) or targets.is_floating_point():
            return out
        with torch.enable_grad():
            recording = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), pred)
            return cast(Tensor, self._call(func, recording, yb))

    def _own_terms(self, learn: EngineHost) -> tuple[Tensor, float, Tensor | None]:
        """The model's own mean loss, counted over the HF `labels` it scored. Which labels it
        scored is read from its output on the first batch of each pass (`own_loss_rule`): a
        wrapper, subclass, compiled or sharded model is counted as it computed."""
        mean = model_loss(learn.pred)
        inputs = learn.xb[0] if len(learn.xb) == 1 and isinstance(learn.xb[0], dict) else {}
        labels = inputs.get("labels")
        self.count_is_rows = labels is None
        if labels is None:
            count = float(batch_size_of(learn.xb))
        else:
            if self._own_rule_for is not learn.dl or self._own_rule is None:
                logits = None
                with contextlib.suppress(ValueError):  # no logits: own_loss_rule refuses, naming the fix
                    logits = output_logits(learn.pred)
                self._own_rule = own_loss_rule(logits, labels, mean)
                self._own_rule_for = learn.dl
            count = float(count_by_rule(self._own_rule, labels))
        if count == 0:  # every label ignored: the model's mean is 0/0
            return zero_loss(learn.pred), 0.0, None
        return mean * count, count, mean

    def to_backward(self, learn: EngineHost, total: Tensor, count: float, mean: Tensor) -> Tensor:
        """What this micro-batch backpropagates: `total / ref` (a full batch's mean, untouched)."""
        global_rows = None
        if self.count_is_rows:
            dl = learn.dl
            global_rows = float(dl.global_rows(learn.iter) if is_rank_sharded(dl) else count)
        ref = self.step.add(count, global_rows, last=learn.grad_sync, collective=learn.collective)
        return mean if count == ref else total / ref

    def normalise_grads(self, learn: EngineHost) -> None:
        """At the step: the gradient of (sum over every rank and micro-batch) / (their count)."""
        factor = self.step.factor(learn.collective)
        if factor == 1.0:
            return
        for p in learn.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

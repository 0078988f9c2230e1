"""Callbacks that change the optimisation step: gradient clipping and accumulation."""

from __future__ import annotations

import torch

from unison.events import Callback, CancelBatchException


class GradientClip(Callback):
    """Clip the global gradient norm to `max_norm` before each optimizer step.

    Runs after DDP has averaged gradients, so every rank clips identically.

        learn.fit(3, cbs=[GradientClip(1.0)])
    """

    order = 0

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0):
        if not max_norm > 0:
            raise ValueError(f"GradientClip: max_norm must be positive, got {max_norm}")
        self.max_norm, self.norm_type = max_norm, norm_type

    def before_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.learn.model.parameters(), self.max_norm, self.norm_type)


class GradientAccumulation(Callback):
    """Step the optimizer every `n_acc` batches, as if the batch were `n_acc` times larger.

    The learner divides the accumulated gradient by the count of loss terms over all
    micro-batches (and ranks), so it is exactly the mean over the large batch, even when
    batches differ in size or a loss counts tokens. On the micro-steps `learn.grad_sync` is False, which
    makes `DistributedTrainer` run them under DDP's `no_sync()`: gradients are
    all-reduced once per step, not once per micro-batch. The last batches of an epoch
    always end in a step.

        learn.fit(3, cbs=[GradientAccumulation(4)])
    """

    order = -20  # decides before anything reads grad_sync or steps
    accumulates_gradients = True  # what FaultTolerantTrainer refuses (it does not import this package)

    def __init__(self, n_acc: int = 2):
        if not isinstance(n_acc, int) or n_acc < 1:
            raise ValueError(f"GradientAccumulation: n_acc must be a positive int, got {n_acc!r}")
        self.n_acc = n_acc

    def before_batch(self) -> None:
        learn = self.learn
        if not learn.training:
            return
        last = learn.iter + 1 == learn.n_iter
        self._step_now = (learn.iter + 1) % self.n_acc == 0 or last
        learn.grad_sync = self._step_now

    def before_step(self) -> None:
        if not self._step_now:
            raise CancelBatchException()  # keep the gradients, skip step and zero_grad

    def before_train(self) -> None:
        self._cancelled = False

    def after_cancel_train(self) -> None:
        self._cancelled = True

    def after_train(self) -> None:
        learn = self.learn
        pending = not learn.grad_sync and not self._cancelled
        learn.grad_sync = True  # validation and other loops always "step"
        if pending:  # a stream shorter than steps_per_epoch: its last batch was not the one expected
            raise ValueError(
                f"fit: the train stream ended after {learn.iter + 1} of steps_per_epoch={learn.n_iter} "
                f"batches, inside an accumulated step of GradientAccumulation({self.n_acc}): its gradient "
                "would be carried into the next epoch's step; give Learner(steps_per_epoch=...) the "
                "batches the stream holds"
            )

    def after_fit(self) -> None:
        self.learn.grad_sync = True  # (a fit cancelled mid-epoch)

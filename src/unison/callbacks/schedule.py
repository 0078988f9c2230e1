"""LR and momentum schedules: the one-cycle policy, and the LR range test (`lr_find`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from unison.callbacks.core import Callback, CancelFitException, CancelValidException

if TYPE_CHECKING:
    from unison.learner import Learner


def cosine(start: float, end: float, pct: float) -> float:
    """Cosine interpolation from `start` (pct=0) to `end` (pct=1)."""
    return end + (start - end) / 2 * (1 + math.cos(math.pi * pct))


def one_cycle(pct: float, peak: float, start: float, end: float, pct_start: float) -> float:
    """Cosine warm-up from `start` to `peak` over `pct_start` of training, then cosine to `end`."""
    if pct < pct_start:
        return cosine(start, peak, pct / pct_start)
    return cosine(peak, end, (pct - pct_start) / max(1e-12, 1 - pct_start))


def set_momentum(opt: torch.optim.Optimizer, mom: float) -> None:
    """Set SGD's `momentum` or Adam-style `betas[0]` on every param group that has one."""
    for group in opt.param_groups:
        if "betas" in group:
            group["betas"] = (mom, *group["betas"][1:])
        elif "momentum" in group:
            group["momentum"] = mom


class OneCycleScheduler(Callback):
    """The one-cycle policy, applied before every training batch from the learner's progress.

    The schedule is a function of `learn.pct_train` alone, so it needs no state of its
    own and a resumed run lands on exactly the same LR.

    >>> learn.fit(5, cbs=[OneCycleScheduler(lr_max=3e-3)])   # what fit_one_cycle does
    """

    order = 10

    def __init__(
        self,
        lr_max: float,
        div: float = 25.0,
        div_final: float = 1e5,
        pct_start: float = 0.25,
        moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95),
    ):
        if not 0 < pct_start < 1:
            raise ValueError(f"pct_start must be in (0, 1), got {pct_start}")
        self.lr_max, self.div, self.div_final, self.pct_start, self.moms = (
            lr_max,
            div,
            div_final,
            pct_start,
            moms,
        )

    def lr_at(self, pct: float) -> float:
        return one_cycle(
            pct, self.lr_max, self.lr_max / self.div, self.lr_max / self.div_final, self.pct_start
        )

    def before_batch(self) -> None:
        learn = self.learn
        if not learn.training or learn.opt is None:
            return
        lr = self.lr_at(learn.pct_train)
        for group in learn.opt.param_groups:
            group["lr"] = lr
        if self.moms is not None:
            high, low, end = self.moms
            set_momentum(learn.opt, one_cycle(learn.pct_train, low, high, end, self.pct_start))


class LRFinder(Callback):
    """Raises the LR exponentially each batch and records the loss; stops when it diverges.

    The recorded loss is averaged over all ranks, so every rank takes the same stop decision.
    """

    order = 10

    def __init__(
        self, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True
    ):
        if not 0 < start_lr < end_lr:
            raise ValueError(f"lr_find needs 0 < start_lr < end_lr, got {start_lr} and {end_lr}")
        self.start_lr, self.end_lr, self.num_it, self.stop_div = start_lr, end_lr, num_it, stop_div
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def before_fit(self) -> None:
        self.best = float("inf")
        self.step = 0

    def before_batch(self) -> None:
        if not self.learn.training or self.learn.opt is None:
            return
        lr = self.start_lr * (self.end_lr / self.start_lr) ** (self.step / max(1, self.num_it - 1))
        for group in self.learn.opt.param_groups:
            group["lr"] = lr
        self._lr = lr

    def after_batch(self) -> None:
        learn = self.learn
        if not learn.training or learn.loss is None:
            return
        collective = learn.collective
        loss = float(collective.sum(learn.loss.detach().float().reshape(1))[0]) / collective.world_size
        self.lrs.append(self._lr)
        self.losses.append(loss)
        self.best = min(self.best, loss)
        self.step += 1
        diverged = self.stop_div and (not math.isfinite(loss) or loss > 4 * self.best)
        if self.step >= self.num_it or diverged:
            raise CancelFitException()

    def before_validate(self) -> None:
        raise CancelValidException()

    def suggestion(self) -> float:
        """A tenth of the LR where the smoothed loss is lowest: safely before the blow-up."""
        if not self.losses:
            return self.start_lr
        smooth, avg = [], 0.0
        for i, loss in enumerate(self.losses):
            avg = 0.9 * avg + 0.1 * loss
            smooth.append(avg / (1 - 0.9 ** (i + 1)))
        best = min(range(len(smooth)), key=lambda i: smooth[i] if math.isfinite(smooth[i]) else math.inf)
        return self.lrs[best] / 10


def lr_find(
    learn: Learner, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True
) -> float:
    """The LR range test: train briefly with a rising LR, then put model and optimizer back.

    Returns a suggested LR; the finder (its `lrs` and `losses`) stays on `learn.lr_finder`.

    >>> lr = learn.lr_find()
    """
    if learn.opt is None:
        learn.create_opt()
    snapshot = learn.snapshot()
    finder = LRFinder(start_lr, end_lr, num_it, stop_div)
    n_batches = max(1, len(learn.dls.train) // max(1, learn.collective.world_size))
    n_epoch = math.ceil(num_it / n_batches)
    try:
        with learn.recorder.pause():
            learn.fit(n_epoch, cbs=[finder])
    finally:
        learn.restore(snapshot)
    learn.lr_finder = finder
    return finder.suggestion()

"""LR and momentum schedules: the one-cycle policy, torch `lr_scheduler`s, the LR range test.

Every schedule keeps the optimizer's param groups: it moves each group's own LR, never
flattens them to one. An LR is a float (each group keeps its ratio to the others), a
`slice(lo, hi)` (groups spread geometrically from lo to hi, fastai's discriminative
LRs) or a list with one LR per group.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from unison.callbacks.recorder import global_means
from unison.callbacks.training import GradientAccumulation
from unison.checkpoint.callback import Checkpoint
from unison.checkpoint.components import kept_hyperparameters
from unison.data.stream import loader_length
from unison.events import Callback, CancelFitException, CancelValidException
from unison.optim import refuse_a_schedule_of_the_loaders_batches, top_lr

if TYPE_CHECKING:
    from unison.learner_view import LearnerView


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

    The schedule is a function of `learn.pct_train` alone, so a resumed run lands on exactly
    the same LR. Its state is the schedule it followed: a run resumed with another length or
    peak (`fit_one_cycle(2)` crashed, `fit_one_cycle(3, resume=True)`) is warned, since its first
    part followed the other schedule.

        learn.fit(5, cbs=[OneCycleScheduler(lr_max=3e-3)])   # what fit_one_cycle does
    """

    order = 10

    def __init__(
        self,
        lr_max: float | slice | Sequence[float],
        div: float = 25.0,
        div_final: float = 1e5,
        pct_start: float = 0.25,
        moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95),
    ):
        if not 0 < pct_start < 1:
            raise ValueError(f"pct_start must be in (0, 1), got {pct_start}")
        self._resumed: str | None = None  # the schedule a checkpoint this fit resumes from followed
        self.lr_max, self.div, self.div_final, self.pct_start, self.moms = (
            lr_max,
            div,
            div_final,
            pct_start,
            moms,
        )

    def _schedule(self) -> str:
        return f"{self.learn.n_epoch} epoch(s) at lr_max {self.lr_max}"

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self._schedule()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = state.get("schedule")  # compared at before_fit, once the fit's length is set

    def before_fit(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None and resumed != self._schedule() and self.learn.collective.is_main:
            warnings.warn(
                f"resuming a one-cycle schedule of {resumed} as one of {self._schedule()}: the run "
                "before the checkpoint followed the other one, so from here it equals neither",
                stacklevel=2,
            )

    def lr_at(self, pct: float, peak: float | None = None) -> float:
        peak = top_lr(self.lr_max) if peak is None else peak
        return one_cycle(pct, peak, peak / self.div, peak / self.div_final, self.pct_start)

    def before_batch(self) -> None:
        learn = self.learn
        if not learn.training or learn.opt is None:
            return
        peaks = learn.group_lrs(self.lr_max)  # each group cycles around its own peak
        for group, peak in zip(learn.opt.param_groups, peaks, strict=True):
            group["lr"] = self.lr_at(learn.pct_train, peak)
        if self.moms is not None:
            high, low, end = self.moms
            set_momentum(learn.opt, one_cycle(learn.pct_train, low, high, end, self.pct_start))


class LRSchedulerCallback(Callback):
    """Drive a torch `lr_scheduler` from the loop: built on the learner's optimizer at `before_fit`,
    stepped after every optimizer step (`interval="batch"`) or every epoch (`"epoch"`).

    A `ReduceLROnPlateau` is stepped once an epoch, after validation, on the recorded value named
    by `monitor` (`"valid_loss"`, `"train_loss"` or a metric's name): the recorder has reduced it
    over every rank, so all ranks step on the same value and keep one learning rate.

        sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        learn.fit(3, cbs=[LRSchedulerCallback(sched)])
        plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=2)
        learn.fit(30, cbs=[LRSchedulerCallback(plateau, monitor="valid_loss")])
    """

    order = 10

    def __init__(
        self,
        make_scheduler: Callable[[torch.optim.Optimizer], Any],
        interval: str = "batch",
        monitor: str = "valid_loss",
    ):
        if interval not in ("batch", "epoch"):
            raise ValueError(f"LRSchedulerCallback: interval must be 'batch' or 'epoch', got {interval!r}")
        self.make_scheduler, self.interval, self.monitor = make_scheduler, interval, monitor
        self.scheduler: Any = None
        self._pending: dict[str, Any] | None = None

    @property
    def on_plateau(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def before_fit(self) -> None:
        # The Learner makes its optimizer before before_fit; a Run set up without one (evaluation
        # only) hands make_scheduler its None, as an LR scheduler's constructor refuses it.
        opt = cast(torch.optim.Optimizer, self.learn.opt)
        if self._pending is None:
            # A fresh schedule starts from this fit's LRs: torch takes a group's `initial_lr`, which a
            # scheduler an earlier fit built on this optimizer left behind, as its base LR instead.
            for group in opt.param_groups if opt is not None else []:
                lr = group["lr"]
                group["initial_lr"] = lr.clone() if isinstance(lr, torch.Tensor) else lr
            self.scheduler = self.make_scheduler(opt)
        else:  # resumed from a checkpoint: the optimizer holds the interrupted run's LR and momentum
            with kept_hyperparameters(opt):  # (the constructor writes its first step's into it)
                self.scheduler = self.make_scheduler(opt)
            self.scheduler.load_state_dict(self._pending)
            self._pending = None
        if self.on_plateau:
            self._index = self.learn.recorder.value_index(
                self.monitor, "LRSchedulerCallback: ReduceLROnPlateau"
            )

    def before_train(self) -> None:
        learn = self.learn
        if self.interval == "batch" and learn.dls.train is not None:  # (a Run's loaders are its own)
            accumulation = learn.get_cb(GradientAccumulation)
            refuse_a_schedule_of_the_loaders_batches(
                self.scheduler,
                f"fit({learn.n_epoch})",
                learn,
                loader_length(learn.dls.train),
                accumulation.n_acc if accumulation is not None else 1,
            )

    def after_step(self) -> None:
        if self.interval == "batch" and not self.on_plateau:
            self.scheduler.step()

    def after_train(self) -> None:
        if self.interval == "epoch" and not self.on_plateau:
            self.scheduler.step()

    def after_epoch(self) -> None:
        recorder = self.learn.recorder
        if not self.on_plateau or recorder.paused:
            return
        self.scheduler.step(recorder.epoch_values()[self._index])

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state


class LRFinder(Callback):
    """Raises the LR exponentially each batch and records the loss; stops when it diverges.

    The recorded loss is the global batch's (every rank's loss terms), so every rank takes the
    same stop decision.
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
        # The sweep moves the top group's LR; the others keep their ratios to it.
        for group, group_lr in zip(self.learn.opt.param_groups, self.learn.group_lrs(lr), strict=True):
            group["lr"] = group_lr
        self._lr = lr

    def after_batch(self) -> None:
        learn = self.learn
        if not learn.training or learn.loss is None:
            return
        # the global batch's loss, as one process sees it
        loss = global_means(learn.collective, [learn.loss.detach()], [float(learn.loss_count)])[0]
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
    learn: LearnerView, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True
) -> float:
    """The LR range test: train briefly with a rising LR, then put model and optimizer back.

    Returns a suggested LR; the finder (its `lrs` and `losses`) stays on `learn.lr_finder`.

        lr = learn.lr_find()
    """
    if learn.opt is None:
        learn.create_opt()
    snapshot = learn.snapshot()
    finder = LRFinder(start_lr, end_lr, num_it, stop_div)
    batches = loader_length(learn.dls.train)  # None: a stream of unknown length
    n_batches = max(1, batches // max(1, learn.collective.world_size)) if batches else 1
    n_epoch = math.ceil(num_it / n_batches)  # enough passes; the finder stops the fit at num_it
    # The sweep is not the run: a checkpoint of its diverging weights would be what a later
    # `fit(resume=True)` continues from, so the learner's Checkpoint callbacks sit it out.
    callbacks = list(learn.cbs)
    for cb in [c for c in callbacks if isinstance(c, Checkpoint)]:
        learn.remove_cb(cb)
    try:
        with learn.recorder.pause():
            learn.fit(n_epoch, cbs=[finder])
    finally:
        learn.restore(snapshot)
        learn.cbs = callbacks
    learn.lr_finder = finder
    return finder.suggestion()

"""Callbacks that watch a recorded value: early stopping and keeping the best model.

The watched value comes from the recorder, which already reduced it over all ranks;
the decision itself is still taken on rank 0 and broadcast, so every rank stops (or
saves) on the same epoch and none is left waiting in a collective.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from unison.events import Callback, CancelFitException


class TrackerCallback(Callback):
    """Tracks `monitor` (`valid_loss`, `train_loss` or a metric name) across epochs."""

    order = 70  # after the Recorder has the epoch's values
    best: float

    def __init__(
        self,
        monitor: str = "valid_loss",
        comp: Callable[[float, float], bool] | None = None,
        min_delta: float = 0.0,
    ):
        self.monitor = monitor
        if comp is None:
            comp = operator.lt if "loss" in monitor or "error" in monitor else operator.gt
        self.comp = comp
        self.min_delta = min_delta if comp is operator.gt else -min_delta
        self._worst = math.inf if comp is operator.lt else -math.inf
        vars(self).update(self.fresh_state())  # best (and a subclass's own: wait, saved) as a fit starts

    def before_fit(self) -> None:
        self.index = self.learn.recorder.value_index(self.monitor, f"{type(self).__name__}:")
        if self.fresh_fit():
            vars(self).update(self.fresh_state())

    def fresh_state(self) -> dict[str, Any]:
        """What a fit from its start tracks from; its names are what a checkpoint keeps (`state_dict`)."""
        return {"best": self._worst}

    def fresh_fit(self) -> bool:
        """A fit from its start tracks afresh; one resumed from a checkpoint keeps the restored state.

        A fit the recorder does not record (`lr_find`'s sweep) is not tracked at all.
        """
        return self.tracking() and self.learn.start_epoch == 0 and self.learn.start_iter == 0

    def tracking(self) -> bool:
        """Whether epochs are being recorded: while the recorder is paused, there is no new value."""
        return not self.learn.recorder.paused

    def improved(self) -> bool:
        """Did this epoch beat the best so far? (rank 0's answer, on every rank)"""
        value = self.learn.recorder.values[-1][self.index]
        better = math.isfinite(value) and self.comp(value - self.min_delta, self.best)
        better = self.learn.collective.agree(better)
        if better:
            self.best = value
        return better

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.fresh_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, fresh in self.fresh_state().items():
            setattr(self, name, state.get(name, fresh))  # (a checkpoint written before `name` was kept)


class EarlyStopping(TrackerCallback):
    """Stop fitting when `monitor` has not improved for `patience` epochs.

    For example:

        learn.fit(50, cbs=[EarlyStopping(patience=3)])
    """

    wait: int  # epochs since the last improvement

    def __init__(
        self,
        monitor: str = "valid_loss",
        comp: Callable[[float, float], bool] | None = None,
        min_delta: float = 0.0,
        patience: int = 1,
    ):
        super().__init__(monitor, comp, min_delta)
        self.patience = patience

    def fresh_state(self) -> dict[str, Any]:
        return {**super().fresh_state(), "wait": 0}

    def after_epoch(self) -> None:
        if not self.tracking():
            return
        if self.improved():
            self.wait = 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            if self.learn.collective.is_main:
                print(
                    f"No improvement in {self.monitor} for {self.wait} epochs: stopping at epoch "
                    f"{self.learn.epoch}.",
                    flush=True,
                )
            raise CancelFitException()


class SaveModelCallback(TrackerCallback):
    """Save the model whenever `monitor` improves (rank 0 writes), and load the best at the end.

    For example:

        learn.fit(10, cbs=[SaveModelCallback(monitor="accuracy", fname="best")])
    """

    saved: bool  # whether a best model was saved (and so is loaded at the end)

    def __init__(
        self,
        monitor: str = "valid_loss",
        comp: Callable[[float, float], bool] | None = None,
        min_delta: float = 0.0,
        fname: str = "model",
        with_opt: bool = False,
        load_best: bool = True,
    ):
        super().__init__(monitor, comp, min_delta)
        self.fname, self.with_opt, self.load_best = fname, with_opt, load_best

    def fresh_state(self) -> dict[str, Any]:
        return {**super().fresh_state(), "saved": False}

    def after_epoch(self) -> None:
        if self.tracking() and self.improved():
            self.learn.save(self.fname, with_opt=self.with_opt)
            self.saved = True

    def after_fit(self) -> None:
        if self.load_best and self.saved and self.tracking():
            self.learn.load(self.fname, with_opt=self.with_opt)

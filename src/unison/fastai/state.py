"""What a checkpoint keeps of a fastai `Learner` under the bridge, in the engine's terms: the
recorder view the engine's callbacks read, fastai's optimizer as plain state (a weights-only load
refuses fastcore's `L` and NumPy scalars), and fastai's data order (`DataOrderState`).

>>> _plain({"hypers": [{"lr": np.float64(0.1)}]})
{'hypers': [{'lr': 0.1}]}
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastcore.foundation import L

import unison.events as unison_events

__all__ = ["DataOrderState", "PlainStateOptimizer", "RecorderView", "as_rng_state", "rng_list"]


class RecorderView:
    """What the engine's callbacks read of a recorder: each step's global loss (kept here) and
    fastai's per-epoch rows and names."""

    def __init__(self, learn: Any) -> None:
        self.learn = learn
        self.losses: list[float] = []

    @property
    def values(self) -> list[Any]:
        # (fastai's Recorder makes its list at its own before_fit, after the bridge's)
        return vars(self.learn.recorder).get("values", [])

    @property
    def metric_names(self) -> list[str]:
        return list(self.learn.recorder.metric_names)

    # What a checkpoint keeps of it: the step losses (fastai's own rows are not restored).
    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])

    def partial_state(self) -> None:
        return None

    def resume_partial(self, partial: Any, rank: int, world_size: int) -> None:
        """Nothing: the recorded losses are global already."""


class PlainStateOptimizer:
    """fastai's optimizer as the engine's checkpoint sees it: its state in plain lists and dicts
    (fastai keeps fastcore `L`s, which a weights-only load refuses); all else is fastai's."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        return _plain(self.opt.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
        self.opt.hypers = L(self.opt.hypers)  # (fastai's own load leaves a list where it keeps an L)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opt, name)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, L)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):  # (fastai's schedules set NumPy floats as learning rates)
        return obj.item()
    return obj


class DataOrderState(unison_events.Callback):
    """What a checkpoint keeps of fastai's data order: the generators the epoch in progress drew its
    order from, as they were before it drew (a mid-epoch resume draws it again): the loader's own
    `rng` and the process's (fastai's tabular loaders shuffle with NumPy's global generator); and the
    loader's `rng` as it is now (an epoch boundary: the next epoch draws from it)."""

    def __init__(self, bridge: Any) -> None:  # (the UnisonBridge: its epoch-start generators)
        self.bridge = bridge
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        bridge = self.bridge
        return {"before_epoch": bridge.order_before_epoch, "now": rng_list(bridge.learn.dls.train.rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def rng_list(rng: Any) -> list[Any]:
    """A `random.Random`'s state as plain lists (what a weights-only checkpoint holds)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def as_rng_state(state: Any) -> tuple[Any, ...]:
    """`random.Random.getstate()`'s tuple again (a checkpoint may give lists back)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)

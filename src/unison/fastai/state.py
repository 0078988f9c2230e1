"""What a checkpoint keeps of a fastai `Learner` under the bridge, in the engine's terms: the
recorder view the engine's callbacks read, fastai's optimizer as plain state (a weights-only load
refuses fastcore's `L` and NumPy scalars), and fastai's data order (`DataOrderState`).

>>> _plain({"hypers": [{"lr": np.float64(0.1)}]})
{'hypers': [{'lr': 0.1}]}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from fastcore.foundation import L

import unison.events as unison_events

__all__ = [
    "CallbackStates",
    "DataOrderState",
    "PlainStateOptimizer",
    "RecorderView",
    "as_rng_state",
    "rng_list",
]


class RecorderView:
    """What the engine's callbacks read of a recorder: each step's global loss (kept here) and
    fastai's per-epoch rows and names."""

    def __init__(self, learn: Any) -> None:
        self.learn = learn
        self.losses: list[float] = []
        self.rows: list[list[Any]] = []  # fastai's rows of the epochs a checkpoint had finished

    @property
    def values(self) -> list[Any]:
        # (fastai's Recorder makes its list at its own before_fit, after the bridge's)
        return vars(self.learn.recorder).get("values", [])

    @property
    def metric_names(self) -> list[str]:
        return list(self.learn.recorder.metric_names)

    # What a checkpoint keeps of it: the step losses and fastai's per-epoch rows (a resumed fit
    # shows the finished epochs' rows again, and fastai's trackers read them).
    # and the smoothed training loss (fastai's train_loss column), which runs on across epochs.
    def state_dict(self) -> dict[str, Any]:
        rows = [[_plain_value(v) for v in row] for row in self.values]
        smooth = getattr(self.learn.recorder, "smooth_loss", None)
        kept = None if smooth is None else [int(smooth.count), _plain_value(smooth.val)]
        return {"losses": list(self.losses), "rows": rows, "smooth_loss": kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])
        self.rows = [list(row) for row in state.get("rows", [])]
        smooth, kept = getattr(self.learn.recorder, "smooth_loss", None), state.get("smooth_loss")
        if smooth is not None and kept is not None:
            smooth.count, smooth.val = kept[0], torch.tensor(kept[1], dtype=torch.as_tensor(smooth.val).dtype)

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


class CallbackStates:
    """What a checkpoint keeps of a fastai `Learner`'s own callbacks (a checkpoint component): each
    callback's `state_dict()` where it has one, else its plain attributes (numbers, strings, flags:
    a tracker's `best` and `wait`), and where each CSVLogger's file began. Loaded after fastai's
    `before_fit`, so a resumed fit's trackers go on from where the interrupted one left them."""

    def __init__(self, learn: Any, csv_starts: dict[str, int]) -> None:
        self.learn = learn
        self.csv_starts = csv_starts  # (the bridge's: CSVLogger key -> its file's size when the fit began)

    def state_dict(self) -> dict[str, Any]:
        states = {key: _callback_state(cb) for key, cb in user_callbacks(self.learn)}
        return {"callbacks": states, "csv_starts": dict(self.csv_starts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = dict(user_callbacks(self.learn))
        for key, saved in state["callbacks"].items():
            cb = mine.get(key)
            if cb is None:
                continue
            if _own_state(cb):
                cb.load_state_dict(saved)
            else:
                for name, value in saved.items():
                    setattr(cb, name, value)
        self.csv_starts.clear()
        self.csv_starts.update(state["csv_starts"])


#: fastai's callbacks that run the loop itself (never paused, never saved as a user's state).
LOOP_CALLBACKS = ("TrainEvalCallback", "Recorder", "ProgressCallback", "ParamScheduler")


def user_callbacks(learn: Any) -> list[tuple[str, Any]]:
    """The learner's callbacks other than fastai's loop and unison's own, each with a stable key
    (class name and its index among its kind)."""
    seen: dict[str, int] = {}
    out = []
    for cb in learn.cbs:
        name = type(cb).__name__
        if name in LOOP_CALLBACKS or type(cb).__module__.startswith("unison."):
            continue
        out.append((f"{name}:{seen.get(name, 0)}", cb))
        seen[name] = seen.get(name, 0) + 1
    return out


def _own_state(cb: Any) -> bool:
    """Whether `cb`'s class defines `state_dict`/`load_state_dict` (a fastai callback reads any
    other attribute from its learner, and so from the model: that one is not the callback's)."""
    return all(callable(getattr(type(cb), name, None)) for name in ("state_dict", "load_state_dict"))


def _callback_state(cb: Any) -> dict[str, Any]:
    if _own_state(cb):
        return cb.state_dict()
    state = {}
    for name, value in vars(cb).items():
        value = _plain_value(value)
        plain = isinstance(value, (bool, int, float, str))
        if plain and name not in ("run", "learn") and not name.startswith("_"):
            state[name] = value
    return state


def _plain_value(value: Any) -> Any:
    """A NumPy scalar or a one-element tensor as a Python number; anything else as it is."""
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value.item()
    return value


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

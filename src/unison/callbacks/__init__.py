"""Callbacks: one concern each, run by the `Learner` at its named events."""

from typing import TYPE_CHECKING

from unison.callbacks.loggers import CSVLogger, TensorBoardLogger
from unison.callbacks.precision import MixedPrecision
from unison.callbacks.progress import ProgressCallback
from unison.callbacks.recorder import Recorder
from unison.callbacks.schedule import LRFinder, LRSchedulerCallback, OneCycleScheduler
from unison.callbacks.tracker import EarlyStopping, SaveModelCallback, TrackerCallback
from unison.callbacks.trackers import MLflowLogger, WandbLogger
from unison.callbacks.training import GradientAccumulation, GradientClip
from unison.events import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
)

if TYPE_CHECKING:  # for type checkers and the API reference; loaded on first use below
    from unison.checkpoint.callback import Checkpoint

__all__ = [
    "CSVLogger",
    "LRSchedulerCallback",
    "TensorBoardLogger",
    "WandbLogger",
    "MLflowLogger",
    "Callback",
    "CancelBatchException",
    "CancelEpochException",
    "CancelFitException",
    "CancelTrainException",
    "CancelValidException",
    "Checkpoint",
    "EVENTS",
    "EarlyStopping",
    "GradientAccumulation",
    "GradientClip",
    "LRFinder",
    "MixedPrecision",
    "OneCycleScheduler",
    "ProgressCallback",
    "Recorder",
    "SaveModelCallback",
    "TrackerCallback",
]


def __getattr__(name: str) -> object:
    """`Checkpoint` on first use: importing `unison.callbacks` does not import the checkpoint package
    (a module there, imported first, as unpickling does, then never meets a half-made package)."""
    if name == "Checkpoint":
        from unison.checkpoint.callback import Checkpoint

        return Checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

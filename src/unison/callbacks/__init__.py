"""Callbacks: one concern each, run by the `Learner` at its named events."""

from unison.callbacks.core import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
)
from unison.callbacks.loggers import CSVLogger, TensorBoardLogger
from unison.callbacks.precision import MixedPrecision
from unison.callbacks.progress import ProgressCallback
from unison.callbacks.recorder import Recorder
from unison.callbacks.schedule import LRFinder, LRSchedulerCallback, OneCycleScheduler
from unison.callbacks.tracker import EarlyStopping, SaveModelCallback, TrackerCallback
from unison.callbacks.training import GradientAccumulation, GradientClip
from unison.checkpoint.callback import Checkpoint

__all__ = [
    "CSVLogger",
    "LRSchedulerCallback",
    "TensorBoardLogger",
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

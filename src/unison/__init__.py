"""unison: exact, fault-tolerant data-parallel training for PyTorch.

>>> from unison import Learner, DataLoaders, accuracy
>>> learn = Learner(DataLoaders(train_dl, valid_dl), model, nn.CrossEntropyLoss(), metrics=[accuracy])
>>> with learn.distrib_ctx():
...     learn.fit_one_cycle(3)
"""

from unison.callbacks import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    GradientAccumulation,
    GradientClip,
    LRFinder,
    LRSchedulerCallback,
    MixedPrecision,
    OneCycleScheduler,
    ProgressCallback,
    Recorder,
    SaveModelCallback,
    TensorBoardLogger,
    TrackerCallback,
)
from unison.data import DataLoaders, to_device
from unison.launch.spawn import SpawnError, mp_spawn, spawn
from unison.learner import Learner
from unison.losses import SummedLoss, TokenCrossEntropy
from unison.metrics import (
    AccumMetric,
    AvgMetric,
    Metric,
    TorchMetric,
    WeightedMean,
    accuracy,
    error_rate,
    roc_auc,
)
from unison.rng import set_seed
from unison.serialization import CheckpointError

__version__ = "0.1.0"

__all__ = [
    "CSVLogger",
    "LRSchedulerCallback",
    "SummedLoss",
    "TensorBoardLogger",
    "TokenCrossEntropy",
    "TorchMetric",
    "AccumMetric",
    "AvgMetric",
    "Callback",
    "CancelBatchException",
    "CancelEpochException",
    "CancelFitException",
    "CancelTrainException",
    "CancelValidException",
    "Checkpoint",
    "CheckpointError",
    "DataLoaders",
    "EVENTS",
    "EarlyStopping",
    "GradientAccumulation",
    "GradientClip",
    "LRFinder",
    "MixedPrecision",
    "Learner",
    "Metric",
    "OneCycleScheduler",
    "ProgressCallback",
    "Recorder",
    "SpawnError",
    "SaveModelCallback",
    "TrackerCallback",
    "WeightedMean",
    "accuracy",
    "error_rate",
    "mp_spawn",
    "roc_auc",
    "set_seed",
    "spawn",
    "to_device",
]

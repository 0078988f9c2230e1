"""unison: exact, fault-tolerant data-parallel training for PyTorch.

For example:

    from unison import Learner, DataLoaders, accuracy
    learn = Learner(DataLoaders(train_dl, valid_dl), model, nn.CrossEntropyLoss(), metrics=[accuracy])
    with learn.distrib_ctx():
        learn.fit_one_cycle(3)
"""

# The names under TYPE_CHECKING are for type checkers; `__all__` is `_EXPORTS`' keys
# (tests/test_layout.py keeps the two alike).
# ruff: noqa: F401
from typing import TYPE_CHECKING

from unison.lazy import lazy_exports

__version__ = "0.1.0"

# The public names load on first use (PEP 562): `unison launch` and `python -m unison.launch`
# import this package before anything else, and must answer a bad option before torch loads
# (importing it takes seconds). Type checkers and IDEs read the imports below.
if TYPE_CHECKING:
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
        MLflowLogger,
        OneCycleScheduler,
        ProgressCallback,
        Recorder,
        SaveModelCallback,
        TensorBoardLogger,
        TrackerCallback,
        WandbLogger,
    )
    from unison.callbacks.nonfinite import NonFiniteCheck, NonFiniteError, NonFiniteWarning
    from unison.callbacks.preemption import Preempted, Preemption
    from unison.checkpoint.errors import CheckpointError
    from unison.checkpoint.sharded import export_state_dict
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
    from unison.run import Run

#: Public name -> the module that defines it.
_EXPORTS = {
    "EVENTS": "unison.callbacks",
    "Callback": "unison.callbacks",
    "CancelBatchException": "unison.callbacks",
    "CancelEpochException": "unison.callbacks",
    "CancelFitException": "unison.callbacks",
    "CancelTrainException": "unison.callbacks",
    "CancelValidException": "unison.callbacks",
    "Checkpoint": "unison.callbacks",
    "CSVLogger": "unison.callbacks",
    "EarlyStopping": "unison.callbacks",
    "GradientAccumulation": "unison.callbacks",
    "GradientClip": "unison.callbacks",
    "LRFinder": "unison.callbacks",
    "LRSchedulerCallback": "unison.callbacks",
    "MixedPrecision": "unison.callbacks",
    "OneCycleScheduler": "unison.callbacks",
    "ProgressCallback": "unison.callbacks",
    "Recorder": "unison.callbacks",
    "SaveModelCallback": "unison.callbacks",
    "TensorBoardLogger": "unison.callbacks",
    "WandbLogger": "unison.callbacks",
    "MLflowLogger": "unison.callbacks",
    "TrackerCallback": "unison.callbacks",
    "DataLoaders": "unison.data",
    "to_device": "unison.data",
    "SpawnError": "unison.launch.spawn",
    "mp_spawn": "unison.launch.spawn",
    "spawn": "unison.launch.spawn",
    "Learner": "unison.learner",
    "Run": "unison.run",
    "SummedLoss": "unison.losses",
    "NonFiniteCheck": "unison.callbacks.nonfinite",
    "NonFiniteError": "unison.callbacks.nonfinite",
    "NonFiniteWarning": "unison.callbacks.nonfinite",
    "Preempted": "unison.callbacks.preemption",
    "Preemption": "unison.callbacks.preemption",
    "TokenCrossEntropy": "unison.losses",
    "AccumMetric": "unison.metrics",
    "AvgMetric": "unison.metrics",
    "Metric": "unison.metrics",
    "TorchMetric": "unison.metrics",
    "WeightedMean": "unison.metrics",
    "accuracy": "unison.metrics",
    "error_rate": "unison.metrics",
    "roc_auc": "unison.metrics",
    "set_seed": "unison.rng",
    "CheckpointError": "unison.checkpoint.errors",
    "export_state_dict": "unison.checkpoint.sharded",
}


__getattr__, __dir__ = lazy_exports("unison", _EXPORTS, globals())

__all__ = sorted(_EXPORTS)

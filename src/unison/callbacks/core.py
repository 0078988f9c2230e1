"""The callback protocol, under its historical name: `unison.events` defines it one layer down, so
that the trainers and the checkpoint callback (packages below `unison.callbacks`) can subclass
`Callback` without importing this package.

>>> from unison.callbacks.core import Callback, CancelFitException
"""

from unison.events import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
)

__all__ = [
    "EVENTS",
    "Callback",
    "CancelBatchException",
    "CancelEpochException",
    "CancelFitException",
    "CancelTrainException",
    "CancelValidException",
]

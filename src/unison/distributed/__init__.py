"""Distributed and parallel training: environment, process group, sharded loader, trainers, sync BN.

>>> from unison.distributed import rank_distrib, num_distrib, rank0_first, DistributedDL

The names load on first use (PEP 562), so importing one light module (`unison.distributed.env`,
as every `unison launch` worker does) does not import FSDP, DTensor and checkpointing: those
imports change torch's state in ways a plain torch script must not inherit from its launcher
(with them loaded, torch's gloo group deadlocked at exit about 1 run in 3, pytorch/pytorch#56297).
"""

# The names under TYPE_CHECKING are for type checkers; `__all__` is `_EXPORTS`' keys
# (tests/test_layout.py keeps the two alike).
# ruff: noqa: F401
from typing import TYPE_CHECKING

from unison.lazy import lazy_exports

if TYPE_CHECKING:
    from unison.data.loader import DistributedDL
    from unison.distributed.collective import Collective
    from unison.distributed.env import DistribEnv, is_main_process, local_rank, num_distrib, rank_distrib
    from unison.distributed.fault_tolerant import FaultTolerantTrainer, ReplicaBehindError, start_lighthouse
    from unison.distributed.group import DEFAULT_TIMEOUT_S, rank0_first, setup_distrib, teardown_distrib
    from unison.distributed.sharded import ShardedTrainer, is_sharded
    from unison.distributed.strategy import ParallelConfig, Strategy
    from unison.distributed.sync_bn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
    from unison.distributed.trainer import (
        DataParallel,
        DistributedDataParallel,
        DistributedTrainer,
        ParallelTrainer,
    )

#: Public name -> the module that defines it.
_EXPORTS = {
    "DistributedDL": "unison.data.loader",
    "Collective": "unison.distributed.collective",
    "DistribEnv": "unison.distributed.env",
    "is_main_process": "unison.distributed.env",
    "local_rank": "unison.distributed.env",
    "num_distrib": "unison.distributed.env",
    "rank_distrib": "unison.distributed.env",
    "DEFAULT_TIMEOUT_S": "unison.distributed.group",
    "rank0_first": "unison.distributed.group",
    "setup_distrib": "unison.distributed.group",
    "teardown_distrib": "unison.distributed.group",
    "FaultTolerantTrainer": "unison.distributed.fault_tolerant",
    "ReplicaBehindError": "unison.distributed.fault_tolerant",
    "start_lighthouse": "unison.distributed.fault_tolerant",
    "ShardedTrainer": "unison.distributed.sharded",
    "is_sharded": "unison.distributed.sharded",
    "ParallelConfig": "unison.distributed.strategy",
    "Strategy": "unison.distributed.strategy",
    "SyncBatchNorm": "unison.distributed.sync_bn",
    "convert_sync_batchnorm": "unison.distributed.sync_bn",
    "revert_sync_batchnorm": "unison.distributed.sync_bn",
    "DataParallel": "unison.distributed.trainer",
    "DistributedDataParallel": "unison.distributed.trainer",
    "DistributedTrainer": "unison.distributed.trainer",
    "ParallelTrainer": "unison.distributed.trainer",
}


__getattr__, __dir__ = lazy_exports("unison.distributed", _EXPORTS, globals())

__all__ = sorted(_EXPORTS)

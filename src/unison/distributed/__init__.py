"""Distributed and parallel training: environment, process group, sharded loader, trainers, sync BN.

>>> from unison.distributed import rank_distrib, num_distrib, rank0_first, DistributedDL
"""

from unison.data.loader import DistributedDL
from unison.distributed.collective import Collective
from unison.distributed.env import DistribEnv, is_main_process, local_rank, num_distrib, rank_distrib
from unison.distributed.group import DEFAULT_TIMEOUT_S, rank0_first, setup_distrib, teardown_distrib
from unison.distributed.sharded import ShardedTrainer, is_sharded
from unison.distributed.sharded_checkpoint import export_state_dict
from unison.distributed.sync_bn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from unison.distributed.trainer import (
    DataParallel,
    DistributedDataParallel,
    DistributedTrainer,
    ParallelTrainer,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Collective",
    "DataParallel",
    "DistribEnv",
    "DistributedDL",
    "DistributedDataParallel",
    "DistributedTrainer",
    "ParallelTrainer",
    "ShardedTrainer",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "export_state_dict",
    "is_main_process",
    "is_sharded",
    "local_rank",
    "num_distrib",
    "rank0_first",
    "rank_distrib",
    "revert_sync_batchnorm",
    "setup_distrib",
    "teardown_distrib",
]

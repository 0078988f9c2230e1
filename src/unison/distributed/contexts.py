"""What `to_parallel`, `to_distributed` and their contexts do to a learner: attach the trainer
callback (`ParallelTrainer`, `DistributedTrainer` for DDP, `ShardedTrainer` for FSDP2), set it
up, and undo it all on the way out, naming a rank that stopped when a collective failed.

>>> to_distributed(learn, shard=True)      # learn.to_distributed(shard=True)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unison.learner_view import LearnerView

# The trainers are imported where they are used: a plain script never loads DDP or FSDP2.


def to_parallel(learn: LearnerView, device_ids: Sequence[int] | None = None) -> None:
    """Single-process `DataParallel` over `device_ids` (all GPUs by default)."""
    from unison.distributed.trainer import ParallelTrainer

    trainer = ParallelTrainer(device_ids)
    learn.add_cb(trainer)
    trainer.setup()


def detach_parallel(learn: LearnerView) -> None:
    from unison.distributed.trainer import ParallelTrainer

    for cb in [c for c in learn.cbs if isinstance(c, ParallelTrainer)]:
        cb.restore()
        learn.remove_cb(cb)


def to_distributed(
    learn: LearnerView,
    cuda_id: int | None = None,
    sync_bn: bool = True,
    timeout: float | None = None,
    backend: str | None = None,
    shard: bool = False,
    **ddp_kwargs: Any,
) -> None:
    """Join (or make) the process group and train with DDP, or FSDP2 with `shard=True`;
    `fault_tolerant=True` (or a dict of `FaultTolerantTrainer`'s options): torchft replicas."""
    from unison.distributed.sharded import ShardedTrainer
    from unison.distributed.trainer import DistributedTrainer

    fault_tolerant = ddp_kwargs.pop("fault_tolerant", False)
    if fault_tolerant and shard:
        raise ValueError(
            "distrib_ctx(fault_tolerant=True and shard=True): torchft replicas are not sharded here; "
            "choose one (fault_tolerant keeps whole replicas, shard=True restarts on a fault)"
        )
    trainer: Any
    if fault_tolerant:
        from unison.distributed.fault_tolerant import FaultTolerantTrainer

        options = fault_tolerant if isinstance(fault_tolerant, dict) else {}
        trainer = FaultTolerantTrainer(timeout=timeout or 30.0, **options)
    else:
        kind = ShardedTrainer if shard else DistributedTrainer
        trainer = kind(cuda_id, sync_bn=sync_bn, timeout=timeout, backend=backend, **ddp_kwargs)
    learn.add_cb(trainer)
    try:
        trainer.setup()
    except BaseException:
        learn.remove_cb(trainer)
        raise


def detach_distributed(learn: LearnerView) -> None:
    """Model, BatchNorm, loaders and logging as they were before `to_distributed`."""
    from unison.distributed.fault_tolerant import FaultTolerantTrainer
    from unison.distributed.sharded import ShardedTrainer
    from unison.distributed.trainer import DistributedTrainer

    kinds = (DistributedTrainer, ShardedTrainer, FaultTolerantTrainer)
    for cb in [c for c in learn.cbs if isinstance(c, kinds)]:
        cb.restore()
        learn.remove_cb(cb)


def name_stalled_rank(learn: LearnerView, exc: Exception) -> None:
    """A collective that failed because another rank stopped: raise the error naming that rank.
    (Only a RuntimeError can be one: this rank's own ValueError or TypeError is its own cause.)"""
    if not isinstance(exc, RuntimeError):
        return
    from unison.distributed.sharded import ShardedTrainer
    from unison.distributed.trainer import DistributedTrainer

    trainer = next((c for c in learn.cbs if isinstance(c, (DistributedTrainer, ShardedTrainer))), None)
    stalled = trainer.diagnose() if trainer is not None else None
    if stalled is not None:
        raise stalled from exc

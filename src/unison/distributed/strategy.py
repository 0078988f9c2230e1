"""One interface for the ways of training data-parallel, chosen from one typed configuration.

A `Strategy` is DDP (`DistributedTrainer`), FSDP2 (`ShardedTrainer`) or torchft replicas
(`FaultTolerantTrainer`): `setup(parts)` takes what the host trains with (`TrainingParts`: model,
optimizer, collective, data seed) and returns what it trains with under the strategy (the model
wrapped or sharded, a `Collective` over the group, which shards every loader and reduces every
metric, rank 0's data seed); `restore()` returns the parts as they were. It writes nothing on the
host: the engine (`unison.engine.attach_strategy`) puts the parts in place. It names a
rank that stopped taking part (`diagnose()`), and says how a checkpoint of its model is written
(`checkpoint_format`: "file", one file rank 0 writes, or "dcp", every rank its own shards). Between
those it takes part in the loop through the events a callback has (`before_batch`, ...). What
DDP and FSDP2 do alike is `unison.distributed.joining`'s (`MonitoredRanks`, `make_collective`, ...).

The host is whatever drives the loop, the `Learner` or the own-loop `Run`: both present the
state a strategy reads (`unison.learner_view.LearnerView`).

`ParallelConfig` is the one place the choice and its options live; `distrib_ctx(...)`,
`to_distributed(...)` and `Run(...)` all build one.

>>> config = ParallelConfig.from_arguments(shard=True, timeout=60)
>>> config.kind
'fsdp'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from unison.loop_state import StartPoint, TrainingParts

if TYPE_CHECKING:
    from unison.distributed.watchdog import RankStalledError
    from unison.learner_view import LearnerView

CheckpointFormat = Literal["file", "dcp"]


@runtime_checkable
class Strategy(Protocol):
    """What the engine asks of a parallel strategy (see the module's docstring)."""

    #: "ddp", "fsdp" or "torchft".
    kind: str
    #: The host whose model it wraps; set before `setup()`.
    learn: LearnerView
    #: True while it trains over more than one process (False on one: nothing to wrap).
    active: bool

    @property
    def checkpoint_format(self) -> str:
        """How a checkpoint of the model is written while this strategy is set up."""
        ...

    def setup(self, parts: TrainingParts) -> TrainingParts:
        """Join (or make) the process group; the parts to train with under the strategy. A refused
        setup raises, leaving no group or thread behind."""
        ...

    def restore(self) -> TrainingParts:
        """Undo `setup()`: the parts as they were before it (the process group is still there)."""
        ...

    def leave(self) -> None:
        """Leave the process group where `setup` made it, once the host let go of the wrapped model."""
        ...

    def start_point(self, point: StartPoint) -> StartPoint:
        """Where the fit about to begin starts, given where the loop would (`point`): unchanged, or
        the step a torchft replica's peers are at, once it healed from them."""
        ...

    def diagnose(self) -> RankStalledError | None:
        """After a failed collective: the rank that stopped taking part, if another one did."""
        ...

    def peers_gone(self) -> list[int] | None:
        """The other ranks that have left or gone silent ([] when all are there; None when it cannot
        tell): after a stop signal, whether the job is failing or being preempted whole."""
        ...


@runtime_checkable
class VotedSteps(Protocol):
    """A strategy whose replicas come and go between steps and vote on each one (torchft): the
    engine asks it for this process's rows of each training step, and, after the step's backward,
    for the vote; a failed step is retaken on the same items (`unison.engine.commit_step`)."""

    def step_share(self, epoch: int, step: int, xb: Any, yb: Any) -> tuple[Any, Any, bool]:
        """This process's `(inputs, targets, whether it has no rows)` of the step (a quorum first,
        when one is due)."""
        ...

    def commit(self) -> tuple[bool, Any, float]:
        """The step's gradient summed over the replicas, then the vote: `(committed, the global
        batch's loss or None, its count)`."""
        ...

    def retake_step(self) -> tuple[Any, Any, bool]:
        """After a failed vote: a new quorum and this process's new share of the same items."""
        ...


@dataclass(frozen=True)
class ParallelConfig:
    """How to train across the processes of a launch: the strategy and its options, checked.

    - `shard`: FSDP2 (`fully_shard`), each rank holding 1/W of weights, gradients and optimizer state.
    - `fault_tolerant`: torchft replicas (True, or a dict of `FaultTolerantTrainer`'s options).
    - `sync_bn`: exact BatchNorm over the global batch (unison's sync BN, CPU included).
    - `timeout`: seconds any collective may wait before the missing rank is named.
    - `cuda_id`: the GPU of this process (default: its local rank's); `backend`: "gloo" trains
      on the CPU even where CUDA is available.
    - `check_data`: every rank must hold the same items (False: the lengths only).
    - `options`: DDP's keyword arguments, or `ShardedTrainer`'s with `shard=True`.

    >>> ParallelConfig.from_arguments(find_unused_parameters=True).options
    {'find_unused_parameters': True}
    """

    shard: bool = False
    fault_tolerant: bool | dict[str, Any] = False
    sync_bn: bool = True
    timeout: float | None = None
    cuda_id: int | None = None
    backend: str | None = None
    check_data: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fault_tolerant and self.shard:
            raise ValueError(
                "distrib_ctx(fault_tolerant=True and shard=True): torchft replicas are not sharded here; "
                "choose one (fault_tolerant keeps whole replicas, shard=True restarts on a fault)"
            )

    @classmethod
    def from_arguments(
        cls,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        backend: str | None = None,
        shard: bool = False,
        **options: Any,
    ) -> ParallelConfig:
        """The configuration `to_distributed(cuda_id, sync_bn, timeout, backend, shard, **options)`
        means: `fault_tolerant` and `check_data` are taken out of `options`, the rest is the
        strategy's own (DDP's or `ShardedTrainer`'s)."""
        fault_tolerant = options.pop("fault_tolerant", False)
        check_data = options.pop("check_data", True)
        return cls(shard, fault_tolerant, sync_bn, timeout, cuda_id, backend, check_data, options)

    @property
    def kind(self) -> str:
        """ "torchft", "fsdp" or "ddp": the strategy this configuration chooses."""
        return "torchft" if self.fault_tolerant else "fsdp" if self.shard else "ddp"


def make_strategy(
    config: ParallelConfig, advertised_host: Callable[[str | None], str] | None = None
) -> Strategy:
    """The strategy `config` chooses, not yet set up. `advertised_host(lighthouse)`: how a torchft
    replica names its own host to the others (the launcher's network helpers; the host name if None).

    >>> make_strategy(ParallelConfig()).kind
    'ddp'
    """
    # Imported here: a plain script never loads DDP, FSDP2 or torchft (nor their torch modules).
    if config.fault_tolerant:
        from unison.distributed.fault_tolerant import FaultTolerantTrainer

        options = config.fault_tolerant if isinstance(config.fault_tolerant, dict) else {}
        return FaultTolerantTrainer(
            timeout=config.timeout or 30.0, advertised_host=advertised_host, **options
        )
    common: dict[str, Any] = {"sync_bn": config.sync_bn, "timeout": config.timeout, "backend": config.backend}
    common["check_data"] = config.check_data
    if config.shard:
        from unison.distributed.sharded import ShardedTrainer

        return ShardedTrainer(config.cuda_id, **common, **config.options)
    from unison.distributed.trainer import DistributedTrainer

    return DistributedTrainer(config.cuda_id, **common, **config.options)

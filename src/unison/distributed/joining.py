"""Joining a job: what both trainers (`DistributedTrainer` for DDP, `ShardedTrainer` for FSDP2)
do alike when they enter and while they train.

- `training_device`: the device this rank trains on (its GPU under NCCL, else the model's).
- `make_collective`: the WORLD group's `Collective`, once every loader is found shardable and
  every rank is found holding the same data; `shared_seed`: rank 0's data seed on every rank.
- `RankMonitor`: a barrier at each epoch that names who misses it, and the watchdog's heartbeats;
  `MonitoredRanks`: the loop's events and the strategy calls both trainers answer through it.

    collective = make_collective(learn, training_device(learn, None))
    seed = shared_seed(collective, learn.data_seed)
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from unison.data.fingerprint import dataset_fingerprint, fingerprint_positions
from unison.data.loader import shard_problem
from unison.distributed.collective import Collective
from unison.distributed.devices import BACKEND_ENV, pick_device
from unison.distributed.env import group_active
from unison.distributed.group import destroy_group, leave_group, resolve_timeout
from unison.distributed.watchdog import RankStalledError, Watchdog
from unison.loop_state import StartPoint

if TYPE_CHECKING:
    from unison.learner_view import EngineHost, LearnerView


def training_device(learn: LearnerView, cuda_id: int | None, backend: str | None = None) -> torch.device:
    """The device a distributed learner trains on: the local rank's GPU (or `cuda_id`) under CUDA,
    else the model's.

    Without CUDA a `cuda_id` (`to_distributed(local_rank)`, as in examples/local_rank.py) is only
    this process's place: it trains on the CPU, as `setup_distrib` binds no GPU. gloo asked for: the CPU too.
    """
    force_cpu = (backend or os.environ.get(BACKEND_ENV)) == "gloo"
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Launched: the local rank's GPU. A script's own processes without LOCAL_RANK (torch's
    # mp.spawn): the GPU it bound with set_device.
    raw = os.environ.get("LOCAL_RANK")
    local_rank = int(raw) if raw is not None else (torch.cuda.current_device() if n_gpus else 0)
    group_backend = dist.get_backend() if group_active() else None
    return pick_device(group_backend, cuda_id, local_rank, n_gpus, learn.device, force_cpu=force_cpu)


def make_collective(learn: LearnerView, device: torch.device, check_data: bool = True) -> Collective:
    """The WORLD group's `Collective`, after checking every loader can be sharded and every rank
    holds the same data."""
    refuse_unshardable(learn, dist.get_world_size())
    collective = Collective(dist.group.WORLD, device=device if dist.get_backend() == "nccl" else None)
    check_loaders_agree(learn, collective, check_data)
    if collective.is_main:
        warn_rank_drawn_dropout(learn.raw_model, collective.world_size)
    return collective


def trainable_set(model: nn.Module) -> tuple[bool, ...]:
    """Which of `model`'s parameters require a gradient, in order: what a wrapper that synchronises
    gradients (DDP, FSDP2) was built for.

    >>> trainable_set(nn.Linear(2, 2).requires_grad_(False))
    (False, False)
    """
    return tuple(p.requires_grad for p in model.parameters())


class RankDrawnDropoutWarning(UserWarning):
    """The model has dropout: each rank draws its masks from its own stream, so W processes end on
    weights of their own (the same on every rank), not one process's."""


def warn_rank_drawn_dropout(model: nn.Module, world_size: int) -> list[str]:
    """Warn, naming the first, where `model` has dropout layers that drop (p > 0) on `world_size` > 1
    processes; return their names. Dropout's masks are drawn per rank, not by the row's position.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as said:
    ...     warnings.simplefilter("always")
    ...     warn_rank_drawn_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)), 2)
    ['1']
    >>> str(said[0].message)[:60]
    "the model's dropout (1, p=0.5) draws its masks on each rank "
    """
    drops = [(name, m) for name, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0]
    if drops and world_size > 1:
        name, first = drops[0]
        warnings.warn(
            f"the model's dropout ({name}, p={first.p}) draws its masks on each rank from the rank's own "
            f"generator: {world_size} processes train to weights of their own (the same on every rank), "
            "not one process's at the global batch; set p=0 (fastai: ps=0) where the run must equal one "
            "process's",
            RankDrawnDropoutWarning,
            stacklevel=2,
        )
    return [name for name, _ in drops]


def refuse_unshardable(learn: LearnerView, world_size: int) -> None:
    """A loader that cannot be sharded fails here, at entry, not after a training epoch."""
    for name, dl in (("train", learn.dls.train), ("valid", learn.dls.valid)):
        problem = shard_problem(dl) if dl is not None else None
        if problem is not None:
            raise ValueError(
                f"distrib_ctx: the {name} loader (dls.{name}) cannot be sharded across "
                f"{world_size} processes: {problem}"
            )


def shared_seed(collective: Collective, data_seed: int) -> int:
    """Rank 0's `data_seed`, on every rank of `collective`: one data order for the whole job."""
    return int(collective.broadcast_object(data_seed))


def check_loaders_agree(
    learn: EngineHost, collective: Collective, check_data: bool = True, loaders: Any = None
) -> None:
    """Every rank must hold the same data: a loader of different length would desynchronise them,
    and different items (random data made without `set_seed`, another file per node) would mix.
    `check_data=False` compares lengths only (data meant to differ). `loaders`: (name, loader)
    pairs to check (default: the learner's train and valid loaders)."""
    dls = loaders if loaders is not None else (("train", learn.dls.train), ("valid", learn.dls.valid))
    local = {
        name: (
            len(dl.dataset) if hasattr(dl.dataset, "__len__") else None,
            dataset_fingerprint(dl.dataset) if check_data else None,
        )
        for name, dl in dls
        if dl is not None
    }
    everyone = collective.gather_objects(local)
    for name in local:
        sizes = [per_rank[name][0] for per_rank in everyone]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"the {name} dataset differs across ranks (sizes by rank: {sizes}): every rank "
                "must build the same dataset; DistributedDL gives each its share"
            )
        prints = [per_rank[name][1] for per_rank in everyone]
        if None not in prints and len(set(prints)) > 1:
            others = [r for r, p in enumerate(prints) if p != prints[0]]
            where = ", ".join(map(str, fingerprint_positions(sizes[0] or 0)))
            raise ValueError(
                f"the {name} dataset differs across ranks: rank(s) {others} hold other items than "
                f"rank 0 (same length {sizes[0]}; items compared at positions {where}): build the "
                "data the same way on every rank (set_seed before making random data, the same "
                "files on every node), or pass distrib_ctx(check_data=False) if it is meant to differ"
            )


class RankMonitor:
    """One rank's part in "no hang": a barrier at each epoch that names who misses it, and
    the `Watchdog`'s heartbeats, so a failed collective names the rank that stopped.
    Shared by `DistributedTrainer` and `ShardedTrainer`.

        monitor = RankMonitor(timeout=60); monitor.epoch_barrier(); monitor.stop()
    """

    def __init__(self, timeout: float | None):
        self.timeout = resolve_timeout(timeout)
        # monitored_barrier names the ranks that miss it, but exists only on gloo.
        self._barrier_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        # On NCCL a timed-out collective aborts the process instead of raising: the heartbeat thread
        # names the missing rank and ends this process first.
        self.watchdog = Watchdog(self.timeout, exit_on_stall=dist.get_backend() == "nccl")
        self.watchdog.start()

    def epoch_barrier(self) -> None:
        """Everyone reaches each epoch, or the job fails naming who did not."""
        wait = timedelta(seconds=self.timeout)
        dist.monitored_barrier(group=self._barrier_group, timeout=wait, wait_all_ranks=True)

    def progress(self, learn: LearnerView, stage: int) -> None:
        self.watchdog.progress(learn.epoch, 0 if learn.training else 1, learn.iter, stage)

    def diagnose(self) -> RankStalledError | None:
        """After a failed collective: the rank that stopped taking part, if another one did."""
        found = self.watchdog.diagnose()
        # The rank the watchdog recorded at start, not dist.get_rank(): the group may already be
        # gone (Ray Train destroys it when a worker dies), and that must not hide who stopped.
        return found if found is not None and found.rank != self.watchdog.rank else None

    def stop(self) -> None:
        self.watchdog.stop()
        if self._barrier_group is not None:
            destroy_group(self._barrier_group)
            self._barrier_group = None


class MonitoredRanks:
    """What `DistributedTrainer` and `ShardedTrainer` answer alike: the `RankMonitor` that setup
    makes over several processes (each epoch's barrier, each batch's stages for the heartbeats, the
    rank that stopped), where every rank starts, and leaving a group setup made."""

    learn: LearnerView
    created_group = False
    monitor: RankMonitor | None = None

    def _at(self, stage: int) -> None:
        """This batch's stage (0 started, 1 in backward, 2 stepped), for the heartbeats."""
        if self.monitor is not None:
            self.monitor.progress(self.learn, stage)

    def before_epoch(self) -> None:
        if self.monitor is not None:
            self.monitor.epoch_barrier()

    def before_backward(self) -> None:
        self._at(1)

    def after_step(self) -> None:
        self._at(2)

    def start_point(self, point: StartPoint) -> StartPoint:
        """Where the loop would start: every rank starts together."""
        return point

    def diagnose(self) -> RankStalledError | None:
        """After a failed collective: the rank that stopped taking part, if another one did."""
        return self.monitor.diagnose() if self.monitor is not None else None

    def peers_gone(self) -> list[int] | None:
        """The other ranks that left or went silent (`Watchdog.peers_gone`)."""
        return self.monitor.watchdog.peers_gone() if self.monitor is not None else None

    def leave(self) -> None:
        """Leave the process group where `setup` made it (`unison.distributed.group.leave_group`)."""
        self.created_group = leave_group(self.created_group)

    def _stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None

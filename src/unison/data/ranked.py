"""The protocol every rank-sharded loader follows (`DistributedDL` for map-style data, `StreamDL`
for streams): what the training loop, the exact loss and the checkpoint ask of this rank's share
of a loader, whichever kind it is.

- `set_epoch(epoch)`: the next iteration plays `epoch`'s order (the same on every rank).
- `set_start(batch_index)`: the next iteration starts at that global step (a resume), nothing
  before it loaded twice.
- `real_rows(batch_index)`: how many leading rows of this rank's batch are real items; the rest
  is padding added to keep every rank in step, which nothing may score.
- `global_rows(batch_index)`: real items of that step over every rank (the exact loss's count).
- `state_dict()` / `load_state_dict(state)`: what a resume needs beyond the step (a stateful
  stream's position; None for a loader the step alone places).

>>> from torch.utils.data import DataLoader
>>> is_rank_sharded(DataLoader(range(4), batch_size=2))
False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import worker as torch_worker

from unison.rng import mix_seed


@runtime_checkable
class RankShardedLoader(Protocol):
    """This rank's share of a loader, iterated one epoch at a time (see the module's docstring)."""

    def set_epoch(self, epoch: int) -> None: ...

    def set_start(self, batch_index: int) -> None: ...

    def real_rows(self, batch_index: int) -> int: ...

    def global_rows(self, batch_index: int) -> int: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


def is_rank_sharded(dl: Any) -> bool:
    """Whether `dl` is already one rank's share (a `DistributedDL`, a `StreamDL`, or any loader that
    follows `RankShardedLoader`), so that nothing shards it again.

    >>> is_rank_sharded(None)
    False
    """
    # Asked every batch: a runtime protocol check of an instance costs 7-14 us, a remembered one of
    # its class nothing (the protocol has methods only, so a class answers for its instances).
    cls = type(dl)
    known = _SHARDED_TYPES.get(cls)
    if known is None:
        known = _SHARDED_TYPES[cls] = issubclass(cls, RankShardedLoader)
    return known


_SHARDED_TYPES: dict[type, bool] = {}


class RankShare:
    """What `DistributedDL` and `StreamDL` share: the `DataLoader` they shard (`dl`, with
    pass-throughs so code written for a DataLoader keeps working), the epoch the next iteration
    plays and the step it starts at, and the inner loaders they load through."""

    rank: int
    seed: int

    def __init__(self, dl: DataLoader) -> None:
        self.dl = dl
        self.epoch = 0
        self._start = 0
        # The inner loader draws its workers' base seed from this generator on every iter(): a private
        # one, reseeded per epoch and rank (`_workers_generator`), keeps the global RNG (dropout)
        # untouched and the worker seeds reproducible, so a resumed run matches.
        self._workers_gen = dl.generator if dl.generator is not None else torch.Generator()

    @property
    def dataset(self) -> Any:
        return self.dl.dataset

    @property
    def drop_last(self) -> bool:
        return self.dl.drop_last

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use the order of `epoch` (a stream's dataset is told it, when it
        has `set_epoch`, as HF and webdataset streams do).

        >>> from unison.data.loader import DistributedDL
        >>> ddl = DistributedDL(DataLoader(range(8), batch_size=2, shuffle=True), 0, 1, seed=0)
        >>> ddl.set_epoch(3); first = next(iter(ddl))
        >>> ddl.set_epoch(3); bool((next(iter(ddl)) == first).all())   # the same epoch, the same order
        True
        """
        self.epoch = int(epoch)

    def set_start(self, batch_index: int) -> None:
        """Continue the next iteration at global step `batch_index` (resume), loading nothing before it:
        a map-style loader skips those batches of its plan; a stream's first items are read and skipped
        without being collated (generic path), or this rank's first `batch_index` batches are read and
        dropped (a self-sharded stream).

        >>> from unison.data.loader import DistributedDL
        >>> ddl = DistributedDL(DataLoader(range(8), batch_size=2), 0, 1)
        >>> ddl.set_epoch(2); ddl.set_start(3)   # continue epoch 2 at its 4th batch
        >>> list(ddl)
        [tensor([6, 7])]
        """
        if batch_index < 0:
            raise ValueError(f"set_start needs a batch index >= 0, got {batch_index}")
        self._start = int(batch_index)

    def _workers_generator(self, epoch: int, salt: str) -> torch.Generator:
        """The workers' generator seeded for `epoch` (`dl`'s own generator, when it has one, as it stands)."""
        if self.dl.generator is None:
            self._workers_gen.manual_seed(mix_seed(self.seed, epoch, self.rank, salt))
        return self._workers_gen

    def _loader_like_dl(self, dataset: Any, **kwargs: Any) -> DataLoader:
        """A `DataLoader` over `dataset` that loads as `dl` does (its workers, their prefetch, init and
        start method, pinning, timeout); `kwargs` give the rest (batching, collate, generator)."""
        dl = self.dl
        if dl.num_workers > 0:
            kwargs["prefetch_factor"] = dl.prefetch_factor
        return DataLoader(
            dataset,
            num_workers=dl.num_workers,
            pin_memory=dl.pin_memory,
            timeout=dl.timeout,
            worker_init_fn=None if dl.worker_init_fn is None else UserWorkerInit(dl.worker_init_fn),
            multiprocessing_context=dl.multiprocessing_context,
            **kwargs,
        )


class UserWorkerInit:
    """`dl`'s `worker_init_fn`, run as a plain DataLoader runs it: `get_worker_info().dataset` is the
    worker's copy of the user's dataset, not unison's wrapper of it (which a per-worker setup, opening
    a database on `info.dataset` say, would reach in vain). A generator the function gives the dataset
    is then searched for (`SeededItems.find_held`), so drawing from it is refused as any held one is."""

    def __init__(self, init_fn: Callable[[int], Any]) -> None:
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        info = torch_worker._worker_info
        if info is None:  # called outside a worker (by hand): nothing to expose
            self.init_fn(worker_id)
            return
        wrapper = info.dataset
        users = getattr(wrapper, "dataset", wrapper)  # SeededItems and RankStream hold it as `dataset`
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=users
        )
        try:
            self.init_fn(worker_id)
        finally:
            torch_worker._worker_info = info
        find_held = getattr(wrapper, "find_held", None)
        if find_held is not None:
            find_held()

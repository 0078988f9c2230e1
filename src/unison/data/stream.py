"""Shard a `DataLoader` over an `IterableDataset` (a stream) across the ranks of a job.

Two ways in:

- Generic: every rank reads the whole stream and keeps the items at positions
  `rank, rank + W, ...`; a rank's DataLoader workers split its items further by whole
  batches (worker `w` makes the rank's batches `w, w + num_workers, ...`, the order in
  which torch's loader takes them). So global step `k` holds stream items
  `[k*W*bs, (k+1)*W*bs)`, as one process with batch size `W*bs` would, and every item
  is read once per epoch across ranks and workers. The dataset must yield the whole
  stream in every process (torch's default for a dataset that ignores `get_worker_info`).
- Self-sharding: a dataset with a `shard(rank, world_size)` method returning the dataset
  of that rank's items (it splits among its DataLoader workers itself, as torch documents),
  or a Hugging Face `datasets.IterableDataset` (split with `split_dataset_by_node`), reads
  only its part.

Every rank stops at the same step: each step all ranks sum their batch's row count (one
small all-reduce), and the epoch ends when the sum is 0. A rank whose stream ended early
yields its last batch again marked as padding (`real_rows` is 0), which the learner trims.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from unison.data.batch import batch_size_of
from unison.data.loader import _mix

_END = object()


def self_sharded(dataset: Any, rank: int, world_size: int) -> Any | None:
    """`dataset`'s own share for `rank` when it can shard itself, else None.

    >>> self_sharded(range(3), 0, 2) is None
    True
    """
    shard = getattr(dataset, "shard", None)
    if callable(shard) and not type(dataset).__module__.startswith("datasets"):
        return shard(rank, world_size)
    if type(dataset).__module__.startswith("datasets") and hasattr(dataset, "n_shards"):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return None


class RankStream(IterableDataset):
    """The items of `dataset` at positions `rank + k * world_size`, split among DataLoader workers
    by blocks of `block` items; the first `skip` of this rank's items are read but not yielded.

    >>> list(RankStream(range(10), rank=1, world_size=3))
    [1, 4, 7]
    """

    def __init__(self, dataset: Any, rank: int, world_size: int, block: int = 1, skip: int = 0) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.block, self.skip = max(1, block), skip

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        w, rank, block, skip = self.world_size, self.rank, self.block, self.skip
        for position, item in enumerate(self.dataset):
            if position % w != rank:
                continue
            local = position // w - skip
            if local >= 0 and (local // block) % workers == worker:
                yield item


def stream_length(dataset: Any) -> int | None:
    """`len(dataset)` when the dataset tells it, else None."""
    try:
        return len(dataset)
    except TypeError:
        return None


def loader_length(dl: Any) -> int | None:
    """Batches per epoch of any loader, or None when it cannot know (a stream without `len()`).

    >>> loader_length(DataLoader(range(10), batch_size=4))
    3
    """
    length = getattr(dl, "length", None)
    if callable(length):
        return length()
    try:
        return len(dl)
    except TypeError:
        return None


class StreamDL:
    """This rank's batches of `dl`, a `DataLoader` over an `IterableDataset`, every rank taking
    the same number of steps.

    `collective` (a `unison.distributed.Collective`) agrees on each step's rows; None on one
    process. `steps_per_epoch` bounds an epoch and gives its length when the dataset has no
    `len()`. `seed` (with the epoch and rank) seeds the DataLoader workers.

    >>> dl = DataLoader(MyStream(), batch_size=8)                       # doctest: +SKIP
    >>> [b.shape for b in StreamDL(dl, rank=0, world_size=1)][:1]       # doctest: +SKIP
    """

    def __init__(
        self,
        dl: DataLoader,
        rank: int = 0,
        world_size: int = 1,
        collective: Any = None,
        steps_per_epoch: int | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(dl.dataset, IterableDataset):
            name = type(dl.dataset).__name__
            raise TypeError(f"StreamDL wraps a loader over an IterableDataset, not {name}")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive int or None, got {steps_per_epoch!r}")
        self.rank, self.world_size, self.collective = rank, world_size, collective
        self.seed = seed
        self.steps_per_epoch = steps_per_epoch
        self.epoch = 0
        self._dl = dl
        self._start = 0
        self._real: list[int] = []
        self._resume_state: dict[str, Any] | None = None
        self._global: list[int] = []
        own = self_sharded(dl.dataset, rank, world_size) if world_size > 1 else None
        self.generic = own is None
        self._source = dl.dataset if own is None else own

    # Pass-throughs so code written for a DataLoader keeps working.
    @property
    def dl(self) -> DataLoader:
        return self._dl

    @property
    def dataset(self) -> Any:
        return self._dl.dataset

    @property
    def batch_size(self) -> int | None:
        return self._dl.batch_size

    @property
    def drop_last(self) -> bool:
        return self._dl.drop_last

    def set_epoch(self, epoch: int) -> None:
        """Tell the dataset (when it has `set_epoch`, as HF and webdataset streams do) the epoch."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any] | None:
        """The state of a self-sharded dataset that offers `state_dict` (as torchdata's stateful
        datasets do), read in this process (`num_workers=0`); None otherwise (resume skips by steps)."""
        source = self._source
        if self.generic or self._dl.num_workers > 0 or not hasattr(source, "state_dict"):
            return None
        return {"dataset": source.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resume the next iteration from `state` (what `state_dict` gave): the dataset continues
        itself, nothing is read twice. Call with the `set_start` of the same step."""
        self._resume_state = state

    def set_start(self, batch_index: int) -> None:
        """Continue the next iteration at global step `batch_index` (resume): the stream's first
        items are read and skipped without being collated (generic path), or this rank's first
        `batch_index` batches are read and dropped (a self-sharded stream)."""
        if batch_index < 0:
            raise ValueError(f"set_start needs a batch index >= 0, got {batch_index}")
        self._start = int(batch_index)

    def _rows_per_step(self) -> int:
        return (self.batch_size or 1) * self.world_size

    def length(self) -> int | None:
        """Steps per epoch: `steps_per_epoch`, else from the dataset's `len()`, else None (unknown)."""
        n = stream_length(self.dataset)
        if n is None:
            return self.steps_per_epoch
        steps = n // self._rows_per_step() if self.drop_last else math.ceil(n / self._rows_per_step())
        return steps if self.steps_per_epoch is None else min(steps, self.steps_per_epoch)

    def __len__(self) -> int:
        steps = self.length()
        if steps is None:
            raise TypeError(
                f"the stream {type(self.dataset).__name__} has no len(): give the dataset a __len__ "
                "or pass Learner(steps_per_epoch=...)"
            )
        return steps

    def real_rows(self, batch_index: int) -> int:
        """Rows of this rank's batch `batch_index` that are stream items (0: a padding batch)."""
        return self._real[batch_index] if batch_index < len(self._real) else 0

    def global_rows(self, batch_index: int) -> int:
        """Stream items in global step `batch_index` over all ranks."""
        return self._global[batch_index] if batch_index < len(self._global) else 0

    def _loader(self, epoch: int, start: int) -> DataLoader:
        dl = self._dl
        dataset = self._source
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        if self.generic:
            skip = start * (self.batch_size or 1)
            dataset = RankStream(dataset, self.rank, self.world_size, self.batch_size or 1, skip)
        kwargs: dict[str, Any] = {}
        if dl.num_workers > 0:
            kwargs["prefetch_factor"] = dl.prefetch_factor
        return DataLoader(
            dataset,
            batch_size=dl.batch_size,
            drop_last=False,  # a whole global step is dropped or kept, below
            collate_fn=dl.collate_fn,
            num_workers=dl.num_workers,
            pin_memory=dl.pin_memory,
            timeout=dl.timeout,
            worker_init_fn=dl.worker_init_fn,
            multiprocessing_context=dl.multiprocessing_context,
            generator=self._worker_generator(epoch),
            **kwargs,
        )

    def _worker_generator(self, epoch: int) -> torch.Generator:
        """The loader draws its workers' base seed from this on every iter(): a private generator
        seeded by epoch and rank keeps the global RNG (dropout) untouched, so a resumed run matches."""
        if self._dl.generator is not None:
            return self._dl.generator
        return torch.Generator().manual_seed(_mix(self.seed, epoch, self.rank, "stream workers"))

    def _agree(self, rows: int, stuck: bool) -> tuple[int, bool]:
        """Every rank's rows summed, and whether any rank has no batch to pad with."""
        if self.collective is None or self.world_size == 1:
            return rows, stuck
        both = self.collective.sum(torch.tensor([rows, int(stuck)], dtype=torch.long))
        return int(both[0]), bool(both[1])

    def __iter__(self) -> Iterator[Any]:
        start, epoch = self._start, self.epoch
        self._start, self.epoch = 0, epoch + 1
        self._real, self._global = [0] * start, [0] * start
        limit = self.steps_per_epoch
        full = self._rows_per_step()
        state, self._resume_state = self._resume_state, None
        if state is not None and start:
            self._source.load_state_dict(state["dataset"])
        batches = iter(self._loader(epoch, 0 if state is not None else start))
        if not self.generic and state is None:  # no state to continue from: read and drop its batches
            for _ in range(start):
                if next(batches, _END) is _END:
                    break
        last: Any = _END
        step = start
        while limit is None or step < limit:
            batch = next(batches, _END)
            rows = 0 if batch is _END else batch_size_of(batch) or 1  # a batch without tensors: 1 row
            total, stuck = self._agree(rows, batch is _END and last is _END)
            if total == 0 or (self.drop_last and total < full):
                return
            if stuck:
                raise ValueError(
                    f"the stream gave a rank no item this epoch while others had {total}: a stream "
                    f"needs at least world_size ({self.world_size}) items"
                )
            if batch is _END:
                batch = last  # padding: keeps this rank in every collective; trimmed by the learner
            self._real.append(rows)
            self._global.append(total)
            last = batch
            yield batch
            step += 1

    def __repr__(self) -> str:
        return f"StreamDL(rank={self.rank}, world_size={self.world_size}, generic={self.generic})"

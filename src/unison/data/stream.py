"""Shard a `DataLoader` over an `IterableDataset` (a stream) across the ranks of a job.

Two ways in:

- Generic (the default, exact): every rank reads the whole stream and keeps the items at
  positions `rank, rank + W, ...`; a rank's DataLoader workers split its items further by
  whole batches (worker `w` makes the rank's batches `w, w + num_workers, ...`, the order in
  which torch's loader takes them). So global step `k` holds stream items
  `[k*W*bs, (k+1)*W*bs)`, as one process with batch size `W*bs` would, and every item
  is read once per epoch across ranks and workers. Each worker reads the dataset with
  `get_worker_info()` hidden (None, as in the main process), so a dataset that splits itself
  among DataLoader workers (torch's recipe, Hugging Face streams) yields the whole stream there.
  The first item each worker of each rank read is fingerprinted (under a fixed seed, so random
  augmentations agree) and compared in the per-step all-reduce: a stream that differs across
  ranks (split by `torch.distributed.get_rank()` in `__iter__`, or shuffled per process) is
  refused before the first step, naming the fix.
- Self-sharding: a dataset with a `shard(rank, world_size)` method returning the dataset
  of that rank's items (it splits among its DataLoader workers itself, as torch documents),
  or a Hugging Face `datasets.IterableDataset` when `split="by_node"` is asked for (split with
  `split_dataset_by_node`: 1/W of the reading, in another order than one process), reads only
  its part. When the dataset has a `len()`, an epoch that ends with another item count is refused.

Every rank stops at the same step: each step all ranks sum their batch's row count (one
small all-reduce), and the epoch ends when the sum is 0. A rank whose stream ended early
yields its last batch again marked as padding (`real_rows` is 0), which the learner trims.

Long on purpose (about 470 lines): the generic and the self-sharding paths share one step
protocol (the per-step all-reduce of row counts and first-item fingerprints), its resume, and
its worker plumbing; split apart they would each repeat it.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from unison.data.batch import batch_size_of
from unison.data.fingerprint import item_print
from unison.data.ranked import RankShare
from unison.rng import mix_seed, seeded_draws

_END = object()
SPLITS = ("exact", "by_node")
_PRINT_BITS = 32


def check_stream_split(split: str) -> str:
    """`split` when it is a known way to split a stream, else `ValueError`.

    >>> check_stream_split("by_node")
    'by_node'
    """
    if split not in SPLITS:
        raise ValueError(
            f'stream_split must be "exact" or "by_node", got {split!r}: "exact" (the default) reads the '
            'whole stream on every rank and trains as one process; "by_node" lets a Hugging Face stream '
            "read only 1/W of it per rank (faster, another order)"
        )
    return split


def _is_hf(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets") and hasattr(dataset, "n_shards")


def self_sharded(dataset: Any, rank: int, world_size: int, split: str = "exact") -> Any | None:
    """`dataset`'s own share for `rank` when it shards itself, else None (the generic, exact path).

    A dataset with `shard(rank, world_size)` always does; a Hugging Face stream only when
    `split="by_node"` (its own split hands whole shards to ranks: not one process's order).

    >>> self_sharded(range(3), 0, 2) is None
    True
    """
    shard = getattr(dataset, "shard", None)
    if callable(shard) and not type(dataset).__module__.startswith("datasets"):
        return shard(rank, world_size)
    if split == "by_node" and _is_hf(dataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return None


class _Tagged:
    """An item carrying the fingerprint of the stream's first item, to the collate function."""

    __slots__ = ("item", "print")

    def __init__(self, item: Any, print_: int) -> None:
        self.item, self.print = item, print_


class _TagCollate:
    """The loader's collate function: `(collate_fn(items), print)`, `print` the stream fingerprint
    a worker attached to its first item (None on its other batches)."""

    def __init__(self, collate_fn: Callable[[Any], Any], batched: bool) -> None:
        self.collate_fn, self.batched = collate_fn, batched

    def __call__(self, data: Any) -> tuple[Any, int | None]:
        print_ = None
        if self.batched and data and isinstance(data[0], _Tagged):
            print_, data[0] = data[0].print, data[0].item
        elif isinstance(data, _Tagged):
            print_, data = data.print, data.item
        return self.collate_fn(data), print_


def _reset_fsspec() -> None:
    """fsspec's event loop and lock made before a fork are not valid in a worker: drop them."""
    try:
        import fsspec.asyn
    except ImportError:
        return
    fsspec.asyn.reset_lock()


def _read_whole(dataset: Any, info: Any) -> Iterator[Any]:
    """`iter(dataset)` read in a DataLoader worker (`info`) as in the main process: `get_worker_info()`
    is None while the dataset makes each item, so a dataset that splits itself among workers
    (torch's recipe) yields the whole stream here, as the generic path needs."""
    items = None
    while True:
        torch_worker._worker_info = None
        try:
            if items is None:
                items = iter(dataset)
            item = next(items, _END)
        finally:
            torch_worker._worker_info = info
        if item is _END:
            return
        yield item


class RankStream(IterableDataset):
    """The items of `dataset` at positions `rank + k * world_size`, split among DataLoader workers
    by blocks of `block` items; the first `skip` of this rank's items are read but not yielded.

    The dataset is read whole in every worker (`get_worker_info()` hidden from it). With
    `seed` (an int, the same on every rank), the first item is read under that fixed seed and its
    fingerprint travels on the worker's first item (`_Tagged`, for `_TagCollate`).

    >>> list(RankStream(range(10), rank=1, world_size=3))
    [1, 4, 7]
    """

    def __init__(
        self, dataset: Any, rank: int, world_size: int, block: int = 1, skip: int = 0, seed: int | None = None
    ) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.block, self.skip, self.seed = max(1, block), skip, seed

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        w, rank, block, skip = self.world_size, self.rank, self.block, self.skip
        if info is not None and _is_hf(self.dataset):
            _reset_fsspec()  # what HF does in a worker (its own worker path is bypassed here)
        items = iter(self.dataset) if info is None else _read_whole(self.dataset, info)
        pending = None
        if self.seed is not None:
            with seeded_draws(self.seed):  # random augmentations make the same first item everywhere
                first = next(items, _END)
            if first is _END:
                return
            pending = item_print(first)
            items = itertools.chain([first], items)
        for position, item in enumerate(items):
            if position % w != rank:
                continue
            local = position // w - skip
            if local >= 0 and (local // block) % workers == worker:
                if pending is not None:
                    item, pending = _Tagged(item, pending), None
                yield item


def _bits(value: int | None) -> list[int]:
    """A fingerprint's bits, least significant first (None, no fingerprint: all 0)."""
    return [((value or 0) >> i) & 1 for i in range(_PRINT_BITS)]


def stream_length(dataset: Any) -> int | None:
    """`len(dataset)` (or of a loader) when it tells it, else None."""
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
    return length() if callable(length) else stream_length(dl)


class StreamDL(RankShare):
    """This rank's batches of `dl`, a `DataLoader` over an `IterableDataset`, every rank taking
    the same number of steps.

    `collective` (a `unison.distributed.Collective`) agrees on each step's rows; None on one
    process. `steps_per_epoch` bounds an epoch and gives its length when the dataset has no
    `len()`. `seed` (with the epoch and rank) seeds the DataLoader workers. `split="by_node"`
    lets a Hugging Face stream read only this rank's shards (not one process's order; said once
    on rank 0); the default `"exact"` reads it as any stream.

    >>> class Numbers(IterableDataset):
    ...     def __iter__(self):
    ...         return iter(torch.arange(20.0))
    >>> [len(b) for b in StreamDL(DataLoader(Numbers(), batch_size=8), rank=0, world_size=1)]
    [8, 8, 4]
    """

    def __init__(
        self,
        dl: DataLoader,
        rank: int = 0,
        world_size: int = 1,
        collective: Any = None,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        split: str = "exact",
    ) -> None:
        if not isinstance(dl.dataset, IterableDataset):
            name = type(dl.dataset).__name__
            raise TypeError(f"StreamDL wraps a loader over an IterableDataset, not {name}")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive int or None, got {steps_per_epoch!r}")
        super().__init__(dl)
        self.rank, self.world_size, self.collective = rank, world_size, collective
        self.seed, self.split = seed, check_stream_split(split)
        self.steps_per_epoch = steps_per_epoch
        self._real: list[int] = []
        self._resume_state: dict[str, Any] | None = None
        self._global: list[int] = []
        own = self_sharded(dl.dataset, rank, world_size, split) if world_size > 1 else None
        self.generic = own is None
        # The stream read: duck-typed (`set_epoch`, `state_dict`, `load_state_dict` when it has them).
        self._source: Any = dl.dataset if own is None else own
        if own is not None and _is_hf(dl.dataset) and rank == 0:
            print(
                f'[unison] stream_split="by_node": the Hugging Face stream {type(dl.dataset).__name__} '
                f"is read 1/{world_size} per rank (split_dataset_by_node): faster, but not the order of one "
                'process, so W processes do not train as one; stream_split="exact" (the default) does',
                file=sys.stderr,
                flush=True,
            )

    @property
    def batch_size(self) -> int | None:
        return self.dl.batch_size

    def state_dict(self) -> dict[str, Any] | None:
        """The state of a self-sharded dataset that offers `state_dict` (as torchdata's stateful
        datasets do), read in this process (`num_workers=0`); None otherwise (resume skips by steps)."""
        source = self._source
        if self.generic or self.dl.num_workers > 0 or not hasattr(source, "state_dict"):
            return None
        return {"dataset": source.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resume the next iteration from `state` (what `state_dict` gave): the dataset continues
        itself, nothing is read twice. Call with the `set_start` of the same step."""
        self._resume_state = state

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
        dl = self.dl
        dataset = self._source
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        collate_fn = dl.collate_fn
        if self.generic:
            skip = start * (self.batch_size or 1)
            seed = mix_seed(self.seed, epoch, "stream first item")
            dataset = RankStream(dataset, self.rank, self.world_size, self.batch_size or 1, skip, seed)
            collate_fn = _TagCollate(dl.collate_fn, batched=dl.batch_size is not None)
        return self._loader_like_dl(
            dataset,
            batch_size=dl.batch_size,
            drop_last=False,  # a whole global step is dropped or kept, below
            collate_fn=collate_fn,
            generator=self._workers_generator(epoch, "stream workers"),
        )

    def _agree(self, rows: int, stuck: bool, print_: int | None, workers_differ: bool) -> tuple[int, bool]:
        """Every rank's rows summed, and whether any rank has no batch to pad with. On the generic
        path the same all-reduce compares the stream fingerprints (`print_`, the first item a worker
        read, on that worker's first batch; bit by bit, so a sum tells equal from not) and refuses
        a stream that differs across ranks or across one rank's workers, on every rank at once."""
        values = [rows, int(stuck)]
        if self.generic:
            values += [int(workers_differ), int(print_ is not None), *_bits(print_)]
        if self.collective is not None and self.world_size > 1:
            values = self.collective.sum(torch.tensor(values, dtype=torch.long)).tolist()
        if self.generic:
            known, bits = values[3], values[4:]
            if any(bit not in (0, known) for bit in bits):
                raise ValueError(self._differs("ranks"))
            if values[2]:
                raise ValueError(self._differs("DataLoader workers"))
        return int(values[0]), bool(values[1])

    def _differs(self, who: str) -> str:
        name = type(self.dataset).__name__
        hf = (
            ' or pass the whole dataset (no split_dataset_by_node) and Learner(stream_split="by_node") '
            "to read 1/W of it per rank"
            if _is_hf(self.dataset)
            else ""
        )
        return (
            f"the stream {name} differs across {who}: the first item each read is not the same, so unison's "
            "exact split would train on a fraction of the data; every rank and worker must read the whole "
            "stream in the same order (seed a shuffle the same everywhere). A dataset that splits itself "
            "by rank (torch.distributed.get_rank() in __iter__) should implement shard(rank, world_size) "
            f"returning that rank's part instead{hf}"
        )

    def _check_count(self, dropped: bool) -> None:
        """A self-sharded epoch read to its end must hold `len(dataset)` items (else its parts
        overlap or miss items: a `shard()` part not split among the rank's workers, say)."""
        n = stream_length(self.dataset)
        total = sum(self._global)
        if self.generic or dropped or n is None or total == n:
            return
        raise ValueError(
            f"the self-sharded stream {type(self.dataset).__name__} gave the {self.world_size} ranks "
            f"{total} items this epoch but len(dataset) is {n}: each rank's part must hold its items once, "
            "split among the rank's DataLoader workers by get_worker_info (torch's recipe); or drop "
            "shard() and let unison split the whole stream exactly"
        )

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
            next(itertools.islice(batches, start, start), None)  # (itertools' `consume` recipe)
        last: Any = _END
        step = start
        first_print: int | None = None
        batch: Any  # a batch, (batch, print) on the generic path, or _END
        while limit is None or step < limit:
            batch, print_ = next(batches, _END), None
            if self.generic and batch is not _END:
                batch, print_ = batch
            workers_differ = print_ is not None and first_print is not None and print_ != first_print
            first_print = print_ if first_print is None else first_print
            rows = 0 if batch is _END else batch_size_of(batch) or 1  # a batch without tensors: 1 row
            total, stuck = self._agree(rows, batch is _END and last is _END, print_, workers_differ)
            if total == 0 or (self.drop_last and total < full):
                if start == 0:  # the stream ended (not steps_per_epoch): the whole epoch was read
                    self._check_count(dropped=total > 0)
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
        where = f"rank={self.rank}, world_size={self.world_size}"
        return f"StreamDL({where}, generic={self.generic}, split={self.split!r})"

"""Shard a plain `DataLoader` across the ranks of a data-parallel job.

Every rank lists the same global order of indices (a function of a seed and the
epoch only), pads it by wrapping to a multiple of the world size and takes every
`world_size`-th position starting at its rank. So the k-th batches of all ranks
together are the k-th batch of one process with batch size `world_size * bs`.

With `pad=False` (how the learner trains) nothing is wrapped: the last global batch
is split unevenly, so the epoch holds exactly the dataset's items. A rank whose share
of that batch is empty gets one padding item, marked by `real_rows` as not real, so
it still yields a batch (and takes part in every collective) that the learner trims.

Each item of a user's dataset is loaded with the generators seeded from its global position in the
epoch's order (`unison.data.item_draws`), so a random augmentation draws the same on any W.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate
from torch.utils.data._utils.fetch import _MapDatasetFetcher
from torch.utils.data.distributed import DistributedSampler

from unison.data.drawn import DrawnOrder
from unison.data.item_draws import SeededItems, draws_reachable, item_seed
from unison.data.permutation import pick_order
from unison.data.plan import Order, PositionPlan, RankPlan, as_order, dealt_plan, sampler_order, strided_plan
from unison.data.ranked import RankShare, is_rank_sharded
from unison.rng import mix_seed


def shard_problem(dl: Any) -> str | None:
    """Why `dl` cannot be sharded across processes, and the way out; None when it can.

    >>> shard_problem(DataLoader(range(8), batch_size=None))
    'it has batch_size=None and no batch_sampler (no batching): ...'
    """
    if is_rank_sharded(dl):
        return None
    if not isinstance(dl, DataLoader):
        return f"it is a {type(dl).__name__}, not a torch DataLoader: wrap the dataset in a DataLoader"
    if isinstance(dl.dataset, IterableDataset):
        return None  # streamed: strided or self-sharded by StreamDL
    if isinstance(dl.sampler, DistributedSampler):
        return "it already has a DistributedSampler: give it a plain sampler (or shuffle=True); unison shards"
    if dl.batch_size is None and dl.batch_sampler is None:
        return (
            "it has batch_size=None and no batch_sampler (no batching): "
            "give it a batch_size or a batch_sampler"
        )
    return None


def _place_in_job() -> tuple[int, int]:
    """(rank, world size) of this process: the process group's when one exists, else what a
    torchrun-style launcher exported (`RANK`, `WORLD_SIZE`), else rank 0 of 1. (The data layer reads
    no scheduler's variables: `unison.distributed.env.rank_distrib` does, for a caller that wants them.)"""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError as exc:
        raise ValueError(f"DistributedDL: RANK / WORLD_SIZE are not integers ({exc})") from None


class _TensorBatches(Dataset):
    """A `TensorDataset` fetched a whole batch at a time: one indexing op per tensor instead
    of one `__getitem__` per sample followed by a stack. Same batches, less Python per batch."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        # index_select, not t[idx]: advanced indexing runs even a small batch on all CPU threads,
        # which then spin ~3.5 ms each (100 CPU ms a step on a 16-thread GPU machine).
        return [t.index_select(0, idx) for t in self.tensors]  # what default_collate makes of the tuples


def _as_batch(batch: Any) -> Any:
    return batch


def fetched_through(dataset: Any, collate_fn: Any) -> tuple[Any, Any]:
    """The dataset and collate function the inner loader uses: a batched fetch where it is exact,
    each item seeded by its position where the dataset's code may draw at random.

    A plain `TensorDataset` with torch's default collate gets `_TensorBatches`; a user's dataset
    `SeededItems` (torch's fetcher calls its `__getitems__`, which keeps a dataset's own one where it
    draws nothing); stored values (a list) are used as they are.

    >>> fetched_through(list(range(4)), default_collate)[0]
    [0, 1, 2, 3]
    """
    if type(dataset) is TensorDataset and collate_fn is default_collate and dataset.tensors:
        return _TensorBatches(dataset), _as_batch
    if draws_reachable(dataset):
        return SeededItems(dataset), collate_fn  # each item's draws a function of its position
    return dataset, collate_fn


class _PlanSampler:
    """The inner loader's batch sampler: yields the batches `DistributedDL.__iter__` planned
    (index lists; int64 tensors for the batched TensorDataset fetch)."""

    def __init__(self, owner: DistributedDL, as_tensor: bool) -> None:
        self.owner, self.as_tensor = owner, as_tensor

    def __iter__(self) -> Iterator[Any]:
        # Bind the plan now: a later plan must not change an iteration in flight.
        plan, start, cut = self.owner._rank_plan, self.owner._plan_start, self.owner.cut_rows
        batches = plan.batches(start, self.as_tensor)
        if isinstance(self.owner._inner.dataset, SeededItems):  # (index, item seed) keys
            seeds = self.owner._seeds
            batches = (list(zip(b, seeds(k, len(b)), strict=True)) for k, b in enumerate(batches, start))
        # Cut lazily: each batch as the loader asks for it (a torchft replica's rows of that step).
        return batches if cut is None else (cut(k, b) for k, b in enumerate(batches, start))

    def __len__(self) -> int:
        return len(self.owner._rank_plan) - self.owner._plan_start


class DistributedDL(RankShare):
    """This rank's share of the batches of `dl`, a map-style `DataLoader`.

    Rank `r` of `W` gets `ceil(n / W)` items per epoch: global positions `r, r+W, ...`
    of the sampler's order, wrapped past the end, in batches of `dl.batch_size`.
    Data are loaded by one inner `DataLoader` built once (so persistent workers
    persist), with `dl`'s dataset, collate function, workers and pinning.

    Each `iter()` plans the epoch `self.epoch`, then adds one to it; trainers call
    `set_epoch(epoch)` before each epoch so the order never depends on how often the
    loader was iterated. With `seed=None` every rank takes rank 0's
    `torch.initial_seed()` (a collective when a process group exists: construct on all ranks).
    `order`: "torch" draws the sampler's own order (a shuffle matches a single-process DataLoader
    bit for bit), "scalable" a constant-memory seeded bijection (`unison.data.permutation`), "auto"
    the first unless a shuffle's permutation tensor would exceed 1 GiB.

    >>> dl = DataLoader(list(range(50)), batch_size=16)
    >>> [b.tolist() for b in DistributedDL(dl, rank=1, world_size=4)][0][:4]
    [1, 5, 9, 13]
    """

    def __init__(
        self,
        dl: DataLoader,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int | None = None,
        pad: bool = True,
        order: str = "auto",
        drawn: DrawnOrder | None = None,
    ) -> None:
        if not isinstance(dl, DataLoader):
            raise TypeError(f"DistributedDL wraps a torch DataLoader, got {type(dl).__name__}")
        if isinstance(dl.dataset, IterableDataset):
            raise ValueError(
                "DistributedDL needs a map-style dataset (with __getitem__ and __len__), "
                f"got an IterableDataset ({type(dl.dataset).__name__}): it cannot be indexed to shard it"
            )
        problem = shard_problem(dl)  # a DistributedSampler, or no batching
        if problem is not None:
            raise ValueError(f"DistributedDL cannot shard this DataLoader: {problem}")
        super().__init__(dl)
        here, world = _place_in_job()
        self.rank = here if rank is None else rank
        self.world_size = world if world_size is None else world_size
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"DistributedDL needs world_size >= 1 and 0 <= rank < world_size, "
                f"got rank={self.rank}, world_size={self.world_size}"
            )
        if seed is None:
            seed = torch.initial_seed() % 2**63
            if dist.is_available() and dist.is_initialized():
                # Ranks seeded differently must still agree on the data order.
                box: list[Any] = [seed]
                dist.broadcast_object_list(box, src=0)
                seed = box[0]
        self.seed = int(seed)
        self.drawn = drawn  # each epoch's order as `dl` itself draws it (else a function of the seed)
        self.order = pick_order(order, dl.sampler, dl.batch_size, announce=self.rank == 0)
        self.pad = pad
        # A custom batch_sampler (length bucketing): in training its batches are dealt across ranks
        # (global step k = the sampler's batch k); in evaluation its batches are joined into one order
        # and strided as any order, so get_preds keeps the loader's order.
        self.dealt = dl.batch_size is None and not pad
        self.joined = dl.batch_size is None and pad
        self._n_planned: int | None = None
        self._rank_plan: RankPlan | PositionPlan = RankPlan([], [0], [])
        self._plan_start = 0
        self._global_sizes: list[int] = []
        self._dealt_cache: tuple[int, list[list[Any]]] | None = None
        #: `cut(batch_index, indices)` -> the indices to load of that batch (None: all of them); a
        #: torchft replica loads only its rows of each step (`unison.distributed.ft_rows`).
        self.cut_rows: Any = None
        dataset, collate_fn = fetched_through(dl.dataset, dl.collate_fn)
        self._positions: tuple[int, int, list[int]] = (0, 0, [])  # (epoch, batch size, dealt batches' starts)
        self._inner = self._loader_like_dl(
            dataset,
            batch_sampler=_PlanSampler(self, as_tensor=isinstance(dataset, _TensorBatches)),
            collate_fn=collate_fn,
            generator=self._workers_gen,
            persistent_workers=dl.persistent_workers,
            pin_memory_device=dl.pin_memory_device,
            in_order=dl.in_order,
        )

    @property
    def sampler(self) -> Any:
        return self.dl.sampler

    @property
    def batch_size(self) -> int:
        """Items per rank per step (a dealt batch sampler: its first batch's share, for information)."""
        if self.dealt or self.joined:
            batches = self._dealt_batches(self.epoch)
            first = batches[0] if self.dealt and batches else max(batches, key=len, default=[])
            return max(1, -(-len(first) // self.world_size))
        return self.dl.batch_size  # type: ignore[return-value]

    def global_order(self, epoch: int) -> Sequence[Any]:
        """The indices of `dl.sampler` for `epoch`: the same on every rank and for any world size
        (a list, to inspect; planning keeps them as an int64 tensor). An order evaluated per
        position (order="scalable", or unshuffled) comes as its `PermutedOrder`, never listed.

        >>> DistributedDL(DataLoader(range(4), shuffle=True), 0, 2, seed=0).global_order(0)
        [1, 0, 3, 2]
        >>> list(DistributedDL(DataLoader(range(4)), 0, 2).global_order(0))
        [0, 1, 2, 3]
        """
        order = self._order_tensor(epoch)
        return order.tolist() if isinstance(order, torch.Tensor) else order

    def _order_tensor(self, epoch: int) -> Order:
        if self.joined:
            return as_order([i for batch in self._dealt_batches(epoch) for i in batch])
        return self._drawn_order(self.sampler, epoch, self.order == "scalable")

    def _drawn_order(self, sampler: Any, epoch: int, scalable: bool = False) -> Order:
        """What `sampler` (the loader's sampler or batch sampler) yields in `epoch`: as `dl` itself
        draws it (`drawn`), else a function of the seed and the epoch."""
        if self.drawn is not None:
            return self.drawn.order(sampler, epoch, scalable)
        return sampler_order(sampler, mix_seed(self.seed, epoch), epoch, scalable)

    def _dealt_batches(self, epoch: int) -> list[list[Any]]:
        """The batch sampler's batches for `epoch` (kept for that epoch: `len()` and `iter()` share them)."""
        if self._dealt_cache is None or self._dealt_cache[0] != epoch:
            # A batch sampler's order is a list of batches (an empty one a tensor), never a PermutedOrder.
            batches = self._drawn_order(self.dl.batch_sampler, epoch)
            self._dealt_cache = (epoch, [list(b) for b in cast("torch.Tensor | list[Any]", batches)])
        return self._dealt_cache[1]

    @property
    def _n(self) -> int:
        # The planned order's length when there is one, else what the sampler announces.
        if self._n_planned is not None:
            return self._n_planned
        if self.joined:
            return sum(len(b) for b in self._dealt_batches(self.epoch))
        return len(self.sampler)

    @property
    def n_items(self) -> int:
        """How many items this rank yields per epoch (`ceil(n / W)`; with `drop_last`, its share of
        the whole global batches, as one process at batch size `W * bs` drops its last one; with
        `pad=False`, its real items of the epoch's global batches)."""
        if self.dealt:
            return sum(len(b[self.rank :: self.world_size]) for b in self._dealt_batches(self.epoch))
        if not self.pad:
            real_items = max(0, math.ceil((self._n - self.rank) / self.world_size))
            return min(real_items, len(self) * self.batch_size)
        if self.drop_last:
            return self._n // (self.world_size * self.batch_size) * self.batch_size
        return math.ceil(self._n / self.world_size)

    @property
    def n_real(self) -> int:
        """How many of this rank's items are real, not wrap-around padding (which always comes last)."""
        if not self.pad:
            return self.n_items
        return max(0, min(self.n_items, math.ceil((self._n - self.rank) / self.world_size)))

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank; `set_start` does not change it)."""
        if self.dealt:
            return len(self._dealt_batches(self.epoch))
        if not self.pad:
            global_bs = self.world_size * self.batch_size
            return self._n // global_bs if self.drop_last else math.ceil(self._n / global_bs)
        return math.ceil(self.n_items / self.batch_size)

    def global_rows(self, batch_index: int) -> int:
        """Real items in global batch `batch_index` over all ranks (`pad=False`: the whole plan is known).

        >>> DistributedDL(DataLoader(list(range(5)), batch_size=2), 0, 2, pad=False).global_rows(1)
        1
        """
        if self.dealt:
            sizes = self._global_sizes
            return sizes[batch_index] if batch_index < len(sizes) else 0
        global_bs = self.world_size * self.batch_size
        return max(0, min(global_bs, self._n - batch_index * global_bs))

    def real_rows(self, batch_index: int) -> int:
        """How many leading rows of batch `batch_index` (of the epoch last iterated) are real items;
        the rest is padding that must never be scored.

        >>> ddl = DistributedDL(DataLoader(list(range(5)), batch_size=2), 1, 2)
        >>> [len(b) for b in ddl], ddl.real_rows(1)
        ([2, 1], 0)
        """
        real = self._rank_plan.real
        return real[batch_index] if batch_index < len(real) else 0

    def batch_indices(self, batch_index: int) -> Any:
        """The dataset indices of this rank's batch `batch_index` of the epoch last iterated, uncut
        (a list of them, or an int64 tensor for the batched `TensorDataset` fetch)."""
        return self._rank_plan.batch(batch_index, isinstance(self._inner.dataset, _TensorBatches))

    def item_seeds(self, batch_index: int) -> list[int]:
        """The seeds the items of this rank's batch `batch_index` (of the epoch last iterated) are
        loaded under: each a function of the data seed, the epoch and the item's global position.

        >>> one, two = (DistributedDL(DataLoader(range(8), batch_size=2), r, w) for r, w in ((0, 1), (1, 2)))
        >>> _, _ = list(one), list(two)
        >>> one.item_seeds(1)[1] == two.item_seeds(0)[1]   # position 3: on one process, on rank 1 of 2
        True
        """
        return self._seeds(batch_index, len(self._rank_plan.batch(batch_index, True)))

    def _seeds(self, batch_index: int, rows: int) -> list[int]:
        epoch, bs, dealt_starts = self._positions  # global batch k starts at position k * bs * W, or dealt's
        first = dealt_starts[batch_index] if self.dealt else batch_index * bs * self.world_size
        return [item_seed(self.seed, epoch, first + self.rank + self.world_size * i) for i in range(rows)]

    def load(self, indices: Any, seeds: Sequence[int] | None = None) -> Any:
        """Load and collate `indices` here, in this process, through the loader's own fetch (torch's
        `_MapDatasetFetcher`: the dataset's `__getitems__` when it has one, else one item at a time),
        each item under its seed of `seeds` (`item_seeds`; None: the generators as they stand).

        >>> DistributedDL(DataLoader(list(range(10)), batch_size=4), 0, 1).load([7, 2])
        tensor([7, 2])
        """
        dataset, collate = self._inner.dataset, self._inner.collate_fn
        if isinstance(dataset, SeededItems):
            keys = None if seeds is None else list(zip(indices, seeds, strict=True))
            dataset, indices = (dataset.dataset, indices) if keys is None else (dataset, keys)
        fetcher = _MapDatasetFetcher(dataset, auto_collation=True, collate_fn=collate, drop_last=False)
        return fetcher.fetch(indices)

    def _plan(self, epoch: int) -> RankPlan | PositionPlan:
        if self.dealt:
            plan, self._global_sizes = dealt_plan(self._dealt_batches(epoch), self.rank, self.world_size)
            self._dealt_cache = None  # the plan holds this rank's part: drop the global batches
            self._positions = (epoch, 0, [0, *itertools.accumulate(self._global_sizes)])
            return plan
        # The epoch's length is what the sampler yields, not its `__len__` (which may differ, as a plain
        # DataLoader also iterates the sampler to its end): the order first, then the batches counted.
        order = self._order_tensor(epoch)
        self._n_planned = len(order)
        bs, n_batches = self.batch_size, len(self)
        self._positions = (epoch, bs, [])
        self._dealt_cache = None
        # Only this rank's 1/W of the order is kept; the global order is freed on return.
        return strided_plan(order, self.rank, self.world_size, bs, n_batches, self.pad)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self._start
        self._start = 0
        self._rank_plan = RankPlan([], [0], [])  # the last epoch's plan is freed before the next is made
        self._rank_plan = self._plan(epoch)
        self._plan_start = start
        self.epoch = epoch + 1
        self._workers_generator(epoch, "workers")
        return iter(self._inner)

    def state_dict(self) -> None:
        """Nothing beyond the step: the epoch's order is a function of the seed and the epoch
        (`RankShardedLoader`'s resume state, which a stream may have)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Accepts what `state_dict` gave (None): `set_start` alone places a resume."""

    def __repr__(self) -> str:
        return (
            f"DistributedDL(rank={self.rank}, world_size={self.world_size}, seed={self.seed}, "
            f"epoch={self.epoch}, batches={len(self)})"
        )

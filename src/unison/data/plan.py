"""One rank's batches of one epoch, held as an int64 tensor (not a Python list).

The global order of an epoch is drawn once (`sampler_order`: torch's own samplers as one
tensor op, any other sampler by iterating it under a pinned RNG); `RankPlan` keeps only
this rank's indices (1/W of them) and the batch bounds, and the global order is dropped.
A batch becomes a list of ints only when the loader asks for it.

The constant-memory order (`PermutedOrder`, order="scalable") is never drawn whole:
`PositionPlan` computes this rank's positions of a batch and evaluates the order there. Nor is
an unshuffled loader's (`SequentialSampler`, whatever the `order` option): its order is
`PermutedOrder.identity(n)`, planned the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import Generator, Tensor
from torch.utils.data import RandomSampler, SequentialSampler

from unison.data.permutation import CHUNK_ITEMS, PermutedOrder, draw_key

# An epoch's order: dataset indices as an int64 tensor, other keys as a list, or one evaluated per position.
Order = Tensor | list[Any] | PermutedOrder


def _fast_order(
    sampler: Any, generator: Generator | None, run_to_end: bool = False
) -> Tensor | PermutedOrder | None:
    """The order `list(sampler)` gives for torch's plain samplers (else None): a `SequentialSampler`'s
    as the identity `PermutedOrder` (nothing of size n is made), a `RandomSampler`'s as one tensor.
    `run_to_end`: also the draw `RandomSampler.__iter__` makes after the last whole permutation (it
    changes no item, only where `generator` stands after)."""
    if type(sampler) is SequentialSampler:
        return PermutedOrder.identity(len(sampler.data_source))
    if type(sampler) is RandomSampler and not sampler.replacement:
        if generator is None:  # as RandomSampler.__iter__ does without one: seeded from the global generator
            generator = Generator().manual_seed(draw_key(None))
        n, wanted = len(sampler.data_source), sampler.num_samples
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        # RandomSampler.__iter__: whole permutations, then the head of one more (same generator).
        parts = [torch.randperm(n, generator=generator) for _ in range(wanted // n)]
        if wanted % n or run_to_end:
            parts.append(torch.randperm(n, generator=generator)[: wanted % n])
        return torch.cat(parts)  # RandomSampler refuses num_samples < 1: never empty
    return None


def as_order(items: list[Any]) -> Tensor | list[Any]:
    """`items` as an int64 tensor when they are ints (dataset indices), else the list itself."""
    if all(isinstance(i, int) for i in items):
        return torch.tensor(items, dtype=torch.long)
    return items


def draw_order(
    sampler: Any, generator: Generator | None, epoch: int, scalable: bool = False, run_to_end: bool = False
) -> Order:
    """What `sampler` yields in `epoch` (told it first, when it has `set_epoch`) drawing from `generator`
    (its `generator` for the draw, then restored; None: as it draws without one, from the global
    generator, which the caller pins), by `_fast_order` where it can and by iterating it otherwise
    (`as_order`). With `scalable`, the `PermutedOrder` keyed from `generator`, as a
    `ScalableRandomSampler` with that generator would yield."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    has_gen = hasattr(sampler, "generator")
    saved = sampler.generator if has_gen else None
    try:
        if has_gen:
            sampler.generator = generator
        if scalable:
            return PermutedOrder(len(sampler), draw_key(generator))
        fast = _fast_order(sampler, generator, run_to_end)
        return fast if fast is not None else as_order(list(sampler))
    finally:
        if has_gen:
            sampler.generator = saved


def sampler_order(sampler: Any, seed: int, epoch: int, scalable: bool = False) -> Order:
    """What `sampler` yields for `epoch`, drawn under `seed` (its generator and the global RNG pinned,
    both restored): an int64 tensor when the indices are ints, else a list. With `scalable` (a
    shuffle of every item once, see `pick_order`), the constant-memory `PermutedOrder` keyed from
    the same generator instead, as a `ScalableRandomSampler` with that generator would yield.
    A `SequentialSampler` gives the identity `PermutedOrder` (evaluated per position).

    >>> sampler_order(RandomSampler(range(4)), seed=0, epoch=0)
    tensor([0, 1, 3, 2])
    >>> sampler_order(SequentialSampler(range(10**10)), seed=0, epoch=0)
    PermutedOrder(n=10000000000, identity)
    """
    # Only the CPU generator: torch.manual_seed would also seed every GPU's (which fork_rng(devices=[])
    # does not restore), so GPU dropout would draw the same numbers on every rank.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return draw_order(sampler, Generator().manual_seed(seed), epoch, scalable)


class RankPlan:
    """This rank's batches: batch `k` is `items[bounds[k]:bounds[k+1]]`, of which the first
    `real[k]` rows are real items (the rest padding).

    >>> plan = RankPlan(torch.tensor([0, 2, 4]), bounds=[0, 2, 3], real=[2, 1])
    >>> list(plan.batches(start=1))
    [[4]]
    """

    def __init__(self, items: Tensor | list[Any], bounds: Sequence[int], real: Sequence[int]) -> None:
        self.items, self.bounds, self.real = items, list(bounds), list(real)

    def __len__(self) -> int:
        return len(self.real)

    def batch(self, k: int, as_tensor: bool = False) -> Any:
        part = self.items[self.bounds[k] : self.bounds[k + 1]]
        if isinstance(part, Tensor) and not as_tensor:
            return part.tolist()
        return part

    def batches(self, start: int = 0, as_tensor: bool = False) -> Iterator[Any]:
        for k in range(start, len(self)):
            yield self.batch(k, as_tensor)


def strided_plan(
    order: Order,
    rank: int,
    world_size: int,
    batch_size: int,
    n_batches: int,
    pad: bool,
) -> RankPlan | PositionPlan:
    """Rank `rank`'s batches of `order`: global positions `rank, rank + W, ...`, `batch_size` at a time.

    `pad=True` wraps positions past the end (every rank gets `n_batches` full-length shares up to
    `ceil(n / W)` items); `pad=False` keeps only real positions, and a rank whose share of a batch is
    empty gets one padding item (so it still takes part in every step). A `PermutedOrder` gets the
    same batches from a `PositionPlan`, evaluated when asked for.
    """
    if isinstance(order, PermutedOrder):
        return PositionPlan(order, rank, world_size, batch_size, n_batches, pad)
    n = len(order)
    if n == 0 or n_batches == 0:
        return RankPlan(order[:0], [0], [])
    real_items = max(0, -(-(n - rank) // world_size))  # positions rank + W*j < n
    take = min(-(-n // world_size) if pad else real_items, n_batches * batch_size)
    # A strided slice for the real positions (no index tensor), then the wrapped ones (pad=True).
    mine = order[rank::world_size][:take]
    wrapped = take - len(mine)
    if wrapped > 0:
        tail = (rank + world_size * torch.arange(len(mine), take)) % n
        if isinstance(order, Tensor):
            mine = torch.cat([cast(Tensor, mine), order[tail]])  # a tensor's slice is a tensor
        else:
            mine = [*mine, *[order[p] for p in tail.tolist()]]
    elif isinstance(mine, Tensor):
        mine = mine.clone()  # its own storage: the global order is freed when the caller drops it
    bounds, real, pads = [0], [], []
    for k in range(n_batches):
        rows = max(0, min((k + 1) * batch_size, take) - k * batch_size)
        real.append(max(0, min(rows, real_items - k * batch_size)))
        if rows == 0:  # an empty share (only ever after every non-empty one): one padding item
            pads.append(order[k % n])
        bounds.append(bounds[-1] + max(rows, 1))
    if pads and isinstance(mine, Tensor):
        mine = torch.cat([mine, torch.stack(pads)])
    elif pads:
        mine = [*mine, *pads]
    return RankPlan(mine, bounds, real)


def dealt_plan(batches: Sequence[Sequence[Any]], rank: int, world_size: int) -> tuple[RankPlan, list[int]]:
    """Rank `rank`'s part of each of the global `batches` (a batch sampler's): `batch[rank::W]`, or one
    padding item of the batch when that is empty. Also each global batch's size.

    >>> plan, sizes = dealt_plan([[5, 6, 7], [8]], rank=1, world_size=2)
    >>> list(plan.batches()), plan.real, sizes
    ([[6], [8]], [1, 0], [3, 1])
    """
    items: list[Any] = []
    bounds, real, sizes = [0], [], []
    for batch in batches:
        batch = list(batch)
        share = batch[rank::world_size]
        real.append(len(share))
        sizes.append(len(batch))
        items.extend(share or batch[:1])
        bounds.append(len(items))
    return RankPlan(as_order(items), bounds, real), sizes


class _RealRows(Sequence[int]):
    """`PositionPlan.real` without a list: the real rows of batch `k`, by arithmetic."""

    def __init__(self, plan: PositionPlan) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, k: Any) -> Any:  # an int: the plan's rows are read one batch at a time
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} outside a plan of {len(self)} batches")
        return self.plan.real_rows(k)


class PositionPlan:
    """This rank's batches of an order evaluated per position (`PermutedOrder`): `RankPlan`'s
    batches, padding and `real` rows, without holding the order or this rank's share of it.

    Items are evaluated `CHUNK_ITEMS` at a time (one chunk kept), starting at the batch asked
    for: a resumed step costs what the first one does.

    >>> plan = PositionPlan(PermutedOrder(10**10, key=1), rank=1, world_size=8, batch_size=4,
    ...                     n_batches=10**9, pad=False)
    >>> len(plan.batch(123_456_789))
    4
    """

    def __init__(
        self, order: PermutedOrder, rank: int, world_size: int, batch_size: int, n_batches: int, pad: bool
    ) -> None:
        n = len(order)
        self.order, self.rank, self.world_size, self.batch_size = order, rank, world_size, batch_size
        self.n_batches = n_batches if n else 0
        self.real_items = max(0, -(-(n - rank) // world_size))  # positions rank + W*j < n
        self.take = min(-(-n // world_size) if pad else self.real_items, n_batches * batch_size)
        self.real = _RealRows(self)
        self._per_chunk = max(1, CHUNK_ITEMS // batch_size)  # batches a chunk holds
        self._chunk: tuple[int, Tensor] = (-1, torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return self.n_batches

    def rows(self, k: int) -> int:
        """Items in this rank's batch `k` (0: an empty share, given one padding item)."""
        return max(0, min((k + 1) * self.batch_size, self.take) - k * self.batch_size)

    def real_rows(self, k: int) -> int:
        return max(0, min(self.rows(k), self.real_items - k * self.batch_size))

    def _items_of_chunk(self, c: int) -> Tensor:
        if self._chunk[0] != c:
            first = c * self._per_chunk * self.batch_size
            last = min(first + self._per_chunk * self.batch_size, self.take)
            positions = (self.rank + self.world_size * torch.arange(first, last)) % len(self.order)
            self._chunk = (c, self.order.at(positions))
        return self._chunk[1]

    def batch(self, k: int, as_tensor: bool = False) -> Any:
        rows = self.rows(k)
        if rows == 0:  # an empty share (only ever after every non-empty one): one padding item
            part = self.order.at(torch.tensor([k % len(self.order)]))
        else:
            c = k // self._per_chunk
            offset = (k - c * self._per_chunk) * self.batch_size
            part = self._items_of_chunk(c)[offset : offset + rows]
        return part if as_tensor else part.tolist()

    def batches(self, start: int = 0, as_tensor: bool = False) -> Iterator[Any]:
        for k in range(start, len(self)):
            yield self.batch(k, as_tensor)

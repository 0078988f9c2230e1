"""A shuffled epoch order that is never held in memory: a seeded bijection of `[0, n)` evaluated per
position, so a rank computes only the positions it needs, when it needs them.

torch's `RandomSampler` draws `randperm(n)`: 8 bytes per item (80 GB at 10^10 items), drawn in
full before the first batch. `PermutedOrder(n, key)` is a keyed Feistel network over the
`ceil(log2 n)`-bit integers, made a bijection of `[0, n)` by cycle walking (a value that falls
outside `[0, n)` is encrypted again until it falls inside; the cycle through a position always
returns to the range, so no two positions share a value). Evaluating a batch of positions is
a fixed number of int64 tensor ops: O(1) memory in `n`, the same order for any number of
ranks, and any position (a resumed step) computed directly.

How good a shuffle it is, measured against `torch.randperm` (tests/data/test_permutation.py,
docs/streaming.md): the position-value table and the pairwise-order frequencies of thousands
of keyed orders pass the same chi-square tests that randperm's pass.

>>> order = PermutedOrder(10, key=7)
>>> sorted(order.at(torch.arange(10)).tolist()) == list(range(10))
True
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch
from torch import Tensor
from torch.utils.data import RandomSampler, Sampler

# Feistel rounds. 4 make a pseudo-random permutation of a large domain (Luby-Rackoff); 8 leave no
# bias the tests can see from 4-bit halves up. Tiny domains (up to 32 items, 1-2 bit halves) are
# biased at 8 (position-value chi-square p = 6e-7 at n=6, 3e-4 at n=5, over 20,000 keys) and not
# at 24, which cost nothing there.
ROUNDS = 8
SMALL_DOMAIN_BITS, SMALL_DOMAIN_ROUNDS = 5, 24
ORDERS = ("auto", "torch", "scalable")
# order="auto" keeps torch's order while its permutation tensor (int64, 8 bytes an item, drawn whole
# in every rank) fits in this many bytes: 2**27 items. Beyond it, the constant-memory order.
ORDER_MEMORY_BYTES = 1 << 30
CHUNK_ITEMS = 1 << 15  # positions evaluated at once by a sampler or plan: 256 KB, a few ms
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 28-bit multiplier: a 32-bit value times it stays below 2**63 (no int64 overflow)


def round_keys(key: int) -> Tensor:
    """The Feistel round keys of `key`: shape `(SMALL_DOMAIN_ROUNDS, 2, 1)`, two 32-bit words a round.

    >>> round_keys(0).shape
    torch.Size([24, 2, 1])
    """
    words = []
    for r in range(SMALL_DOMAIN_ROUNDS):
        digest = hashlib.blake2b(repr(("unison-feistel", int(key), r)).encode(), digest_size=8).digest()
        words += [int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]
    return torch.tensor(words, dtype=torch.long).view(SMALL_DOMAIN_ROUNDS, 2, 1)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (every output bit depends on every input bit), in int64 without
    overflow; in place on `x` (fresh tensors per op made it 5-8x slower)."""
    x ^= x >> 16
    x *= _MUL
    x &= _M32
    x ^= x >> 16
    x *= _MUL
    x &= _M32
    x ^= x >> 16
    return x


def _encrypt(x: Tensor, bits: int, keys: Tensor) -> Tensor:
    """One pass of an (unbalanced when `bits` is odd) Feistel network over `bits`-bit values.

    A round maps (L, R) to (R, L ^ F(R)): invertible whatever F is, so the whole is a bijection of
    `[0, 2**bits)`; the halves swap widths each round. `keys`: `(rounds, 2, 1 or len(x))`."""
    wl, wr = bits // 2, bits - bits // 2
    left, right = x >> wr, x & ((1 << wr) - 1)
    for k in range(SMALL_DOMAIN_ROUNDS if bits <= SMALL_DOMAIN_BITS else ROUNDS):
        f = _mix32(right ^ keys[k, 0])  # a new tensor: `right` stays as it is
        f ^= keys[k, 1]
        f = _mix32(f)
        f &= (1 << wl) - 1
        f ^= left
        left, right = right, f
        wl, wr = wr, wl
    left <<= wr  # `left` is a tensor made in this function: changing it in place is safe
    left |= right
    return left


def permute(positions: Tensor, n: int, keys: Tensor) -> Tensor:
    """The values at `positions` (each in `[0, n)`) of the bijection keyed by `keys` (`round_keys`).

    >>> permute(torch.arange(5), 5, round_keys(1)).sort().values.tolist()
    [0, 1, 2, 3, 4]
    """
    x = positions.to(torch.long)
    if n <= 1:
        return x.clone()
    bits = (n - 1).bit_length()  # 2**bits < 2n: fewer than half the values walk again
    per_item = keys.shape[-1] > 1
    y = _encrypt(x, bits, keys)
    walking = (y >= n).nonzero().squeeze(1)
    while walking.numel():  # cycle walking: re-encrypt those outside [0, n) until inside
        step = _encrypt(y[walking], bits, keys[..., walking] if per_item else keys)
        y[walking] = step
        walking = walking[step >= n]
    return y


def draw_key(generator: torch.Generator | None) -> int:
    """A permutation key drawn from `generator` (the global RNG when None), as `RandomSampler`
    draws its seed: the same generator state gives the same key, so the same order.

    >>> draw_key(torch.Generator().manual_seed(0)) == draw_key(torch.Generator().manual_seed(0))
    True
    """
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class PermutedOrder(Sequence[int]):
    """The shuffled order of `n` items under `key`, evaluated on demand: `order[i]` is the item at
    global position `i`; `order.at(positions)` evaluates a tensor of positions at once.

    `key=None` is the identity permutation (`PermutedOrder.identity(n)`): an unshuffled loader's
    order (torch's `SequentialSampler`), planned and resumed per position by the same machinery.

    >>> order = PermutedOrder(10**10, key=3)          # nothing of size n is made
    >>> first = order.at(torch.arange(4))             # the first four items of the epoch
    >>> bool(((first >= 0) & (first < 10**10)).all())
    True
    >>> PermutedOrder.identity(10**10)[-1]
    9999999999
    """

    def __init__(self, n: int, key: int | None) -> None:
        if n < 0:
            raise ValueError(f"PermutedOrder needs n >= 0 items, got {n}")
        if n > 1 << 62:
            raise ValueError(f"PermutedOrder handles up to 2**62 items, got {n}")
        self.n, self.key = int(n), None if key is None else int(key)
        self._keys = None if self.key is None else round_keys(self.key)

    @classmethod
    def identity(cls, n: int) -> PermutedOrder:
        """The order `0, 1, ..., n-1` (what `SequentialSampler` yields), evaluated per position."""
        return cls(n, key=None)

    def __len__(self) -> int:
        return self.n

    def at(self, positions: Tensor) -> Tensor:
        """The items at `positions` (an integer tensor of values in `[0, n)`), a new tensor."""
        if self._keys is None:
            return positions.to(torch.long, copy=True)
        return permute(positions, self.n, self._keys)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.at(torch.arange(*i.indices(self.n))).tolist()
        if not -self.n <= i < self.n:
            raise IndexError(f"position {i} outside an order of {self.n} items")
        return int(self.at(torch.tensor([i % self.n]))[0])

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self.n, CHUNK_ITEMS):
            yield from self.at(torch.arange(start, min(start + CHUNK_ITEMS, self.n))).tolist()

    def __repr__(self) -> str:
        return f"PermutedOrder(n={self.n}, {'identity' if self.key is None else f'key={self.key}'})"


def many_orders(n: int, keys: Sequence[int]) -> Tensor:
    """Whole orders of `n` items under each of `keys` at once, shape `(len(keys), n)` (statistics).

    >>> many_orders(4, [1, 2]).sort(dim=1).values.tolist()
    [[0, 1, 2, 3], [0, 1, 2, 3]]
    """
    per_key = torch.cat([round_keys(k) for k in keys], dim=2)  # (rounds, 2, K)
    flat_keys = per_key.repeat_interleave(n, dim=2)
    positions = torch.arange(n).repeat(len(keys))
    return permute(positions, n, flat_keys).view(len(keys), n)


class ScalableRandomSampler(Sampler[int]):
    """A shuffling sampler in constant memory: `RandomSampler`'s role, `PermutedOrder`'s order.

    Each `iter()` draws a key from `generator` (the global RNG when None) and yields the keyed
    order chunk by chunk. Under unison a loader with this sampler is sharded in that order (its
    generator pinned to the data seed), each rank evaluating only its own positions.

    >>> sampler = ScalableRandomSampler(range(10), generator=torch.Generator().manual_seed(0))
    >>> sorted(sampler) == list(range(10)), len(sampler)   # every item once
    (True, 10)
    """

    def __init__(self, data_source: Any, generator: torch.Generator | None = None) -> None:
        self.data_source, self.generator = data_source, generator

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        return iter(PermutedOrder(len(self.data_source), draw_key(self.generator)))


def _can_be_scalable(sampler: Any) -> bool:
    """Whether `sampler`'s role is a plain shuffle of every item once (what `PermutedOrder` gives)."""
    if isinstance(sampler, ScalableRandomSampler):
        return True
    return (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    )


def pick_order(order: str, sampler: Any, batch_size: int | None, announce: bool = False) -> str:
    """Which order a sharded loader draws, `"torch"` (its sampler's own, materialised) or
    `"scalable"` (`PermutedOrder`), for the option `order` ("auto", "torch" or "scalable").

    "auto" keeps torch's order unless the sampler is a `ScalableRandomSampler`, or a plain
    `RandomSampler` whose permutation tensor would exceed `ORDER_MEMORY_BYTES`; then it prints one
    line when `announce`. The choice depends on `n` only, never on the world size.

    >>> pick_order("auto", RandomSampler(range(10)), batch_size=4)
    'torch'
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, got {order!r}")
    fits = batch_size is not None and _can_be_scalable(sampler)  # a batch sampler sets its own order
    if order == "torch":
        return "torch"
    if order == "scalable":
        if not fits:
            what = "a batch_sampler" if batch_size is None else type(sampler).__name__
            raise ValueError(
                'order="scalable" shuffles every item once: it needs a DataLoader with shuffle=True and a '
                f"batch_size (a RandomSampler without replacement or num_samples), got {what}"
            )
        return "scalable"
    if not fits:
        return "torch"
    if isinstance(sampler, ScalableRandomSampler):
        return "scalable"
    n = len(sampler)
    if 8 * n <= ORDER_MEMORY_BYTES:
        return "torch"
    if announce:
        print(
            f"[unison] shuffling {n:,} items: torch's permutation would take {8 * n / 2**30:.1f} GiB "
            f"per rank (over {ORDER_MEMORY_BYTES / 2**30:g} GiB), so the order is a constant-memory "
            'seeded bijection; order="torch" keeps torch\'s',
            file=sys.stderr,
            flush=True,
        )
    return "scalable"

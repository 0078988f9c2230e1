"""fastai's random augmentation drawn by position: every draw of an item transform is a function of
the item's global position in the epoch and the epoch's seed, every draw of a random batch transform
too (per item), never of the process that loads the item. On W processes each rank then makes the
very images one process makes (DataLoader workers included: the seed travels with the loader).

fastai draws item transforms (`RandomResizedCrop`, `FlipItem`, `Resize`'s crop) in `after_item`,
item by item, from the loading process's generators, and batch transforms (`aug_transforms`,
`RandomErasing`) in `after_batch` on the collated batch: per batch (a `RandTransform`'s `p`,
`batch=True`) or per row (tensors of shape `(bs,)`). On W ranks each would draw for its own share.

Here, `RankShardedFastaiDL` hands `seeded_batches` `(index, position)` keys: each item is made with
Python's, NumPy's and torch's CPU generators seeded from `(epoch seed, position)` and put back after
it. A batch whose `after_batch` holds a random transform (`RandTransform`) runs it row by row
(`after_batch_by_item`), each row seeded from its position (on a GPU batch, that device's generator
too): a decision fastai alone makes once per batch is made per item. The epoch seed is a digest of
fastai's own loader generator when the epoch's order is drawn (`epoch_seed`): it follows the
script's `set_seed`, differs every epoch, is the same on every rank, and a checkpoint restores it.

A loader whose items fastai does not make through `DataLoader.do_item` and `create_batches` (a
subclass overriding them) cannot be seeded this way: a random transform in it, or in `before_batch`
(run on the list of items), is refused on W > 1 processes, named (`refuse_unseeded`).
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any

import torch

from unison.data.batch import batch_size_of, map_tensors, tensors_in
from unison.rng import mix_seed, seeded_draws

__all__ = [
    "after_batch_by_item",
    "draws_by_position",
    "epoch_seed",
    "random_transforms",
    "refuse_unseeded",
    "seeded_batches",
]


def epoch_seed(rng: random.Random) -> int:
    """The seed of an epoch's augmentation: a digest of fastai's loader generator `rng` (what the
    script's `set_seed` made it, moved on every epoch), the same on every rank; `rng` is not moved.

    >>> epoch_seed(random.Random(1)) == epoch_seed(random.Random(1)) != epoch_seed(random.Random(2))
    True
    """
    digest = hashlib.blake2b(repr(rng.getstate()).encode(), digest_size=8).digest()
    return mix_seed(int.from_bytes(digest, "little"))


def random_transforms(pipeline: Any) -> list[Any]:
    """The random transforms (fastai's `RandTransform`) of a fastai `Pipeline` (or loader hook).
    None unless fastai's vision augmentation was imported (it defines them): nothing imports it here."""
    augment = sys.modules.get("fastai.vision.augment")
    rand_transform = getattr(augment, "RandTransform", None)
    if rand_transform is None:
        return []
    return [t for t in getattr(pipeline, "fs", []) if isinstance(t, rand_transform)]


def draws_by_position(dl: Any) -> bool:
    """Whether fastai makes `dl`'s items through its own `DataLoader.do_item` and `create_batches`
    (a `TfmdDL`: images, text), so that each item can be made with generators seeded by position."""
    from fastai.data.core import TfmdDL
    from fastai.data.load import DataLoader

    own = ("do_item", "create_item", "create_batches")
    return (
        isinstance(dl, TfmdDL)
        and not dl.prebatched
        and all(getattr(type(dl), name) is getattr(DataLoader, name) for name in own)
        and not any(name in vars(dl) for name in own)
    )


def refuse_unseeded(dl: Any) -> None:
    """One line naming a random transform whose draws cannot be made a function of position on W
    processes: in `before_batch` (it sees the list of a rank's items), or in a loader that makes its
    items itself (see `draws_by_position`)."""
    where = ["before_batch"] if draws_by_position(dl) else ["after_item", "before_batch", "after_batch"]
    for hook in where:
        found = random_transforms(getattr(dl, hook, None))
        if found:
            raise ValueError(
                f"unison.fastai: the random transform {type(found[0]).__name__} in {type(dl).__name__}."
                f"{hook} draws from each rank's own generators, so W processes would not make one "
                "process's images; move it to item_tfms or batch_tfms of fastai's own DataLoader"
            )


def seeded_batches(dl: Any, keys: Iterator[tuple[int, int]], seed: int) -> Iterator[Any]:
    """fastai's `DataLoader.create_batches` over `(index, position)` keys: item `index` is made (read,
    `after_item`) with the generators seeded from `seed` and its `position` in the epoch, the same in
    the main process and in a DataLoader worker."""
    if dl.dataset is not None:
        dl.it = iter(dl.dataset)
    items = (_seeded_item(dl, index, mix_seed(seed, position, "item")) for index, position in keys)
    yield from map(dl.do_batch, dl.chunkify(item for item in items if item is not None))


def _seeded_item(dl: Any, index: int, seed: int) -> Any:
    with seeded_draws(seed):
        return dl.do_item(index)


def after_batch_by_item(dl: Any, batch: Any, positions: Sequence[int], seed: int) -> Any:
    """`dl.after_batch` on each row of `batch` alone, seeded from `seed` and the row's position in the
    epoch, the rows then put together again: each row's draws are its own, whichever rank holds it."""
    rows = batch_size_of(batch)
    if rows != len(positions):
        raise ValueError(
            f"unison.fastai: a batch of {rows} rows where the plan deals {len(positions)} (an item skipped "
            "with SkipItemException): its rows' augmentation cannot be placed"
        )
    device = next((t.device for t in tensors_in(batch)), None)
    done = []
    for row, position in enumerate(positions):
        with seeded_draws(mix_seed(seed, position, "batch"), device):
            done.append(dl.after_batch(map_tensors(itemgetter(slice(row, row + 1)), batch)))
    return _stack_rows(done)


def _stack_rows(rows: list[Any]) -> Any:
    first = rows[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(rows)
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_rows(list(parts)) for parts in zip(*rows, strict=True))
    return first

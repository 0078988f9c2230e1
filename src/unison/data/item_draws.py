"""Random draws of a data pipeline made a function of the item's place in the epoch, never of the
process that loads it.

A random transform in a `Dataset` (torchvision's `transforms.v2`, NumPy, Python's `random`) draws
from the loading process's generators. On W processes each rank would draw for its own share, so
the images, and the weights trained on them, would differ from one process's. `DistributedDL`
therefore fetches each item of a map-style dataset with Python's, NumPy's and torch's CPU generators
seeded from `item_seed(seed, epoch, position)`: the data seed, the epoch and the item's global
position in the epoch's order (a padded duplicate has a position of its own). The rank, the
DataLoader worker and what was drawn before play no part, and after the batch each generator is
where it was, so the training stream (dropout) is untouched.

Draws from a generator the dataset holds itself (a `torch.Generator`, a NumPy `Generator` or
`RandomState`, a `random.Random`) cannot be reached: one that moves while items load is refused,
named (`HeldGenerators`).

>>> class Noisy(Dataset):
...     def __len__(self): return 4
...     def __getitem__(self, i): return i + torch.rand(1).item()
>>> items = SeededItems(Noisy())
>>> items[(2, 7)] == items[(2, 7)] != items[(2, 8)]
True
>>> from unison.rng import seeded_draws
>>> with seeded_draws(7): expected = Noisy()[2]   # what seeding the generators with 7 gives
>>> items[(2, 7)] == expected
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from unison.data.held_generators import PROCESS_GENERATORS, HeldGenerators, same_states, states
from unison.rng import generators_kept, mix_seed, seed_generators

__all__ = ["SeededItems", "draws_reachable", "item_seed"]

# Containers whose items are stored values: fetching one draws nothing, so nothing is seeded.
_DRAWLESS = (list, tuple, range, str, bytes, np.ndarray, torch.Tensor, TensorDataset)


def item_seed(seed: int, epoch: int, position: int) -> int:
    """The seed an item's draws start from: a function of the data seed, the epoch and the item's
    global position in that epoch's order, the same on every process.

    >>> item_seed(0, 1, 5) == item_seed(0, 1, 5) != item_seed(0, 2, 5)
    True
    """
    return mix_seed(seed, epoch, position, "item")


def draws_reachable(dataset: Any) -> bool:
    """Whether fetching from `dataset` runs code that may draw at random (a user's `Dataset`), so
    its items are loaded seeded; not for stored values (a list, a tensor, a `TensorDataset`).

    >>> draws_reachable(list(range(4))), draws_reachable(TensorDataset(torch.zeros(4)))
    (False, False)
    """
    return not isinstance(dataset, _DRAWLESS)


class SeededItems(Dataset):
    """`dataset` fetched by `(index, seed)` keys: item `index` is loaded with the generators seeded
    from `seed` (as `seeded_draws(seed)` seeds them), in the main process or a DataLoader worker
    alike, and the generators are restored after each batch.

    A dataset with its own batched fetch (`__getitems__`, Hugging Face `datasets`) keeps it while its
    batches draw nothing; the first batch that draws is fetched again item by item, as is every later
    one (the fetch is exact either way)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.find_held()
        self._batched = callable(getattr(dataset, "__getitems__", None))

    def find_held(self) -> None:
        """Search the dataset for generators it holds (again after a DataLoader worker's
        `worker_init_fn`, which may have given it one)."""
        self.held = HeldGenerators(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[Any, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[Any, int]]) -> list[Any]:
        before = self.held.states()
        with generators_kept():
            items = self._fetch_batched(keys) if self._batched else None
            if items is None:
                items = []
                for index, seed in keys:
                    seed_generators(seed)
                    items.append(self.dataset[index])
        self.held.refuse_moved(before)
        return items

    def _fetch_batched(self, keys: Sequence[tuple[Any, int]]) -> list[Any] | None:
        """The dataset's own batched fetch of `keys`, or None where it drew at random (then never again)."""
        seed = keys[0][1] if keys else 0
        seed_generators(seed)
        seeded = states(PROCESS_GENERATORS)
        items = list(self.dataset.__getitems__([index for index, _ in keys]))
        if same_states(seeded, states(PROCESS_GENERATORS)):
            return items
        self._batched = False
        return None

"""What the inner `DataLoader` of a `DistributedDL` fetches through: a `TensorDataset` a whole batch
at a time, a user's dataset item by item under each item's seed (`unison.data.item_draws`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from unison.data.item_draws import SeededItems, draws_reachable

__all__ = ["SeededItems", "fetched_through"]


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

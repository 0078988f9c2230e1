"""Random draws of a dataset's items as a function of the item's position in the epoch: the same
on one process and on each rank of W, in DataLoader workers too, the training stream untouched,
and a generator the dataset holds itself refused by name."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from unison.data.loader import DistributedDL
from unison.rng import mix_seed, seeded_draws


class Augmented(Dataset):
    """Item i, moved by a draw of each of torch's, NumPy's and Python's global generators."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        noise = torch.rand(1, dtype=torch.float64) + np.random.rand() + random.random()
        return torch.tensor([float(i)], dtype=torch.float64) + noise


def expected_epoch(dataset: Dataset, order: list[int], seed: int, epoch: int) -> torch.Tensor:
    """The items of one epoch as the documented rule draws them, written out here: the item at global
    position p under the generators seeded with mix_seed(seed, epoch, p, "item")."""
    items = []
    for position, index in enumerate(order):
        with seeded_draws(mix_seed(seed, epoch, position, "item")):
            items.append(dataset[index])
    return torch.cat(items)


def epoch_rows(dl: DataLoader, world: int, epoch: int) -> tuple[list[int], torch.Tensor]:
    """The global order and the items of `epoch` put together from the ranks of `world`, by position."""
    shares = []
    for rank in range(world):
        ddl = DistributedDL(dl, rank, world, seed=5, pad=False)
        ddl.set_epoch(epoch)
        shares.append(torch.cat([b.flatten() for b in ddl]))
    order = list(DistributedDL(dl, 0, 1, seed=5).global_order(epoch))
    rows = torch.zeros(len(order), dtype=torch.float64)
    for rank, share in enumerate(shares):
        rows[rank::world] = share[: len(rows[rank::world])]
    return order, rows


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_item_draws_from_its_position_whatever_the_world_size_and_workers(world, workers):
    dl = DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=workers)
    order, rows = epoch_rows(dl, world, epoch=1)
    assert torch.equal(rows, expected_epoch(Augmented(), order, seed=5, epoch=1))


def test_loading_items_leaves_the_training_stream_where_it_was():
    ddl = DistributedDL(DataLoader(Augmented(), batch_size=4), 0, 1, seed=5)
    torch.manual_seed(3)
    for _ in ddl:
        pass
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))


class BatchedAugmented(Augmented):
    """A dataset with its own batched fetch that draws: fetched item by item instead."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def test_a_batched_fetch_that_draws_is_fetched_item_by_item():
    dl = DataLoader(BatchedAugmented(), batch_size=3, shuffle=True)
    order, rows = epoch_rows(dl, 2, epoch=0)
    assert torch.equal(rows, expected_epoch(Augmented(), order, seed=5, epoch=0))


class HeldRng(Dataset):
    def __init__(self) -> None:
        self.augment = {"jitter": np.random.default_rng(0)}

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> float:
        return i + self.augment["jitter"].random()


def test_a_generator_the_dataset_holds_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"dataset.augment\['jitter'\], a numpy Generator the dataset holds"):
        list(DistributedDL(DataLoader(HeldRng(), batch_size=2), 0, 1))


class HeldQuietRng(HeldRng):
    """Holds a generator that draws only in __init__ (fixed data): nothing to refuse."""

    def __getitem__(self, i: int) -> float:
        return float(i)


def test_a_held_generator_that_never_draws_while_loading_is_accepted():
    batches = list(DistributedDL(DataLoader(HeldQuietRng(), batch_size=2), 0, 1))
    assert [b.tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]

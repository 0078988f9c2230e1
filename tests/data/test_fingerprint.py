"""dataset_fingerprint: length and a few items at fixed positions, under a fixed seed."""

import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, TensorDataset

from unison.data.fingerprint import dataset_fingerprint, fingerprint_positions


def test_same_data_same_print_and_a_changed_item_or_length_shows():
    x = torch.arange(40.0).reshape(20, 2)
    base = dataset_fingerprint(TensorDataset(x, x[:, 0].long()))
    assert base == dataset_fingerprint(TensorDataset(x.clone(), x[:, 0].long()))
    changed = x.clone()
    changed[fingerprint_positions(20)[2], 1] += 1e-6  # one value, at a position that is read
    assert dataset_fingerprint(TensorDataset(changed, x[:, 0].long())) != base
    assert dataset_fingerprint(TensorDataset(x[:19], x[:19, 0].long())) != base
    assert dataset_fingerprint(TensorDataset(x.double(), x[:, 0].long())) != base  # dtype counts


def test_plain_python_items_dicts_and_arrays():
    items = [{"a": np.arange(3), "b": "text", "c": [1, 2.5, None]} for _ in range(7)]
    assert dataset_fingerprint(items) == dataset_fingerprint([dict(d) for d in items]) is not None
    other = [dict(d) for d in items]
    other[0] = {**other[0], "b": "other"}
    assert dataset_fingerprint(other) != dataset_fingerprint(items)


def test_streams_have_none_and_random_state_is_left_alone():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert dataset_fingerprint(Stream()) is None

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(2) + random.random() + float(np.random.rand())

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    first = dataset_fingerprint(Noisy())
    after = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(9)  # another RNG state: the augmentation is drawn the same way anyway
    assert dataset_fingerprint(Noisy()) == first
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    assert (torch.rand(1), random.random(), np.random.rand()) == after  # nothing was drawn

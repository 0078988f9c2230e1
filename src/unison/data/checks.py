"""Checks on the loaders a `Learner` is given, made before `fit` changes anything."""

from __future__ import annotations

from typing import Any

from unison.data.stream import loader_length, stream_length


def refuse_empty_train(dl: Any, name: str = "dls.train") -> None:
    """Raise `ValueError` naming `name` when the train loader would yield no batch at all.

    An empty train set otherwise "trains" an epoch with a `nan` loss and succeeds. Loaders
    whose length cannot be known without reading them (an `IterableDataset`) pass unchecked.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> refuse_empty_train(DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=4))
    Traceback (most recent call last):
    ValueError: fit: the train loader (dls.train) is empty: its dataset (TensorDataset) has 0 items, ...
    """
    dataset = getattr(dl, "dataset", None)
    items, batches = stream_length(dataset), loader_length(dl)
    if items == 0:
        raise ValueError(
            f"fit: the train loader ({name}) is empty: its dataset ({type(dataset).__name__}) has 0 items, "
            "nothing to train on"
        )
    if batches == 0:
        raise ValueError(
            f"fit: the train loader ({name}) yields no batch: {items} item(s) with "
            f"batch_size={getattr(dl, 'batch_size', '?')} and drop_last=True (use a smaller batch_size "
            "or drop_last=False)"
        )

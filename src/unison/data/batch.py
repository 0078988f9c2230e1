"""`DataLoaders`: the train and valid loaders of a `Learner`, plus device moves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """`batch` with every tensor moved to `device` (tuples, lists and dicts are walked).

    >>> to_device((torch.zeros(1), {"y": torch.ones(1)}), "cpu")[1]["y"]
    tensor([1.])
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from tensors_in(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_in(v)


def take_rows(x: Any, n: int) -> Any:
    """The first `n` samples of a (nested) batch."""
    if isinstance(x, Tensor):
        return x[:n] if x.dim() else x
    if isinstance(x, (list, tuple)):
        return type(x)(take_rows(v, n) for v in x)
    if isinstance(x, dict):
        return {k: take_rows(v, n) for k, v in x.items()}
    return x


def cat_padded(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate along dim 0, zero-padding later dims to the largest (variable-length outputs)."""
    if not parts:
        return torch.zeros(0)
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(list(parts))
    trailing = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_zeros([sum(p.shape[0] for p in parts), *trailing])
    row = 0
    for p in parts:
        out[(slice(row, row + len(p)), *(slice(0, n) for n in p.shape[1:]))] = p
        row += len(p)
    return out


class DataLoaders:
    """A training and a validation `DataLoader`, as a `Learner` expects them.

    >>> dls = DataLoaders(DataLoader(train_ds, batch_size=64, shuffle=True),
    ...                   DataLoader(valid_ds, batch_size=128))
    >>> dls.train, dls.valid, len(dls.loaders)
    """

    def __init__(self, train: DataLoader, valid: DataLoader | None = None):
        for name, dl in (("train", train), ("valid", valid)):
            if dl is not None and not isinstance(dl, DataLoader):
                raise TypeError(f"DataLoaders: {name} must be a torch DataLoader, got {type(dl).__name__}")
        if train is None:
            raise TypeError("DataLoaders: a train DataLoader is required")
        self.train = train
        self.valid = valid

    @property
    def loaders(self) -> Sequence[DataLoader]:
        return [dl for dl in (self.train, self.valid) if dl is not None]

    def __iter__(self) -> Iterator[DataLoader]:
        return iter(self.loaders)

    def __getitem__(self, i: int) -> DataLoader:
        return self.loaders[i]

    def __len__(self) -> int:
        return len(self.loaders)

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{n}={len(dl.dataset)} items"
            for n, dl in (("train", self.train), ("valid", self.valid))
            if dl is not None and hasattr(dl.dataset, "__len__")
        )
        return f"DataLoaders({sizes})"

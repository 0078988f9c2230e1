"""A cheap fingerprint of a dataset, to check at `distrib_ctx` entry that every rank holds the same one.

Ranks that build different data (random data made without `set_seed`, another file on another
node) would otherwise train together silently on a mix. Comparing lengths alone misses that; reading
the whole set is too dear. The fingerprint is the length plus a few items at fixed positions (first,
last and evenly between), read under a fixed random seed so that random augmentations in
`__getitem__` give the same values on every rank, and with every RNG put back afterwards.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

from unison.rng import seeded_draws

__all__ = ["dataset_fingerprint", "fingerprint_positions", "item_print"]

_MAX_VALUES = 1 << 16  # values hashed per tensor, at most: the check must stay cheap


def fingerprint_positions(n: int, samples: int = 5) -> list[int]:
    """The positions read: first, last and evenly between (at most `samples`).

    >>> fingerprint_positions(48)
    [0, 11, 23, 35, 47]
    """
    if n <= 0:
        return []
    return sorted({(n - 1) * i // max(1, samples - 1) for i in range(samples)})


def dataset_fingerprint(dataset: Any, samples: int = 5) -> str | None:
    """A short digest of `len(dataset)` and the items at `fingerprint_positions`; None for a stream.

    None also when an item cannot be read (the loader will report that itself, with its traceback).

    >>> from torch.utils.data import TensorDataset
    >>> a = dataset_fingerprint(TensorDataset(torch.arange(10.0)))
    >>> a == dataset_fingerprint(TensorDataset(torch.arange(10.0))), len(a)
    (True, 16)
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    if not hasattr(dataset, "__getitem__"):
        return None
    n = len(dataset)
    digest = hashlib.sha256(f"len={n}".encode())
    try:
        with seeded_draws(0):
            for i in fingerprint_positions(n, samples):
                _feed(digest, dataset[i])
    except Exception:
        return None
    return digest.hexdigest()[:16]


def item_print(item: Any) -> int:
    """A 32-bit digest of one item's values, the same in every process for equal items.

    >>> item_print((torch.tensor([1.0]), 3)) == item_print((torch.tensor([1.0]), 3))
    True
    """
    digest = hashlib.blake2b(digest_size=4)
    _feed(digest, item)
    return int.from_bytes(digest.digest(), "little")


def _feed(digest: Any, item: Any) -> None:
    """Hash `item`'s values (tensors and arrays by their bytes, containers item by item)."""
    if isinstance(item, torch.Tensor):
        t = item.detach().cpu()
        t = t.to_dense() if t.is_sparse else t
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        flat = t.flatten()
        if flat.numel() > _MAX_VALUES:  # a large item (a volume, a long clip): an evenly strided sample
            flat = flat[:: flat.numel() // _MAX_VALUES]
        digest.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
    elif type(item).__module__ == "numpy" and hasattr(item, "tobytes"):
        digest.update(f"A{item.dtype}{getattr(item, 'shape', ())}".encode())
        digest.update(item.tobytes())
    elif isinstance(item, Mapping):
        for key in sorted(item, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, item[key])
    elif isinstance(item, (list, tuple)):
        digest.update(f"S{len(item)}".encode())
        for part in item:
            _feed(digest, part)
    elif isinstance(item, (set, frozenset)):  # by sorted member digests: set order varies per process
        digest.update(f"U{len(item)}".encode())
        for part in sorted(_member_digest(member) for member in item):
            digest.update(part)
    elif isinstance(item, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(item).encode())
    else:  # images and other objects: by their pickled state (never by id, which differs per process)
        try:
            digest.update(pickle.dumps(item, protocol=4))
        except Exception:
            digest.update(type(item).__qualname__.encode())


def _member_digest(item: Any) -> bytes:
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, item)
    return digest.digest()

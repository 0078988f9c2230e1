"""Generators a dataset holds itself (a `torch.Generator`, a NumPy `Generator` or `RandomState`, a
`random.Random`): unison seeds the process's generators per item, but cannot reach these. One that
moves while items load draws as a function of the loading process's past, so W processes would
train on other images than one process: that is refused, naming where the generator is held.

>>> class Jitter:
...     def __init__(self): self.rng = np.random.default_rng(0)
...     def __getitem__(self, i): return i + self.rng.random()
>>> data = Jitter()
>>> held = HeldGenerators(data)
>>> before = held.states(); _ = data[0]
>>> held.refuse_moved(before)
Traceback (most recent call last):
...
ValueError: unison: dataset.rng, a numpy Generator the dataset holds, drew while items loaded: ...
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["PROCESS_GENERATORS", "HeldGenerators", "same_states", "states"]

_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_DEPTH = 5  # how far into attributes, lists and dicts the search goes
# The process's own generators, which unison seeds per item (so the search skips them).
PROCESS_GENERATORS = (random._inst, np.random.mtrand._rand, torch.default_generator)
_SHARED = tuple(id(generator) for generator in PROCESS_GENERATORS)


def _held(obj: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if id(obj) in seen or depth > _DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, _GENERATORS):
        if id(obj) not in _SHARED and not isinstance(obj, random.SystemRandom):  # the OS's draws: no state
            yield path, obj
        return
    if isinstance(obj, (str, bytes, int, float, bool, torch.Tensor, np.ndarray, type(None))):
        return
    if isinstance(obj, dict):
        children: Any = ((f"{path}[{key!r}]", value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple)):
        children = ((f"{path}[{k}]", value) for k, value in enumerate(obj))
    else:
        children = ((f"{path}.{name}", value) for name, value in getattr(obj, "__dict__", {}).items())
    for child_path, child in list(children)[:1000]:  # a dataset's list of a million paths is not searched
        yield from _held(child, child_path, depth + 1, seen)


def _state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, np.random.RandomState):
        return generator.get_state(legacy=False)
    return generator.getstate()


def states(generators: Iterable[Any]) -> list[Any]:
    """The state of each of `generators` (torch's, NumPy's or Python's), to compare with `same_states`."""
    return [_state(generator) for generator in generators]


def same_states(before: list[Any], after: list[Any]) -> bool:
    return all(map(_same, before, after))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


class HeldGenerators:
    """The generators held in `dataset`'s attributes (searched once, a few levels deep), to check
    that none moves while items load."""

    def __init__(self, dataset: Any) -> None:
        self.found = list(_held(dataset, "dataset", 0, set()))

    def states(self) -> list[Any]:
        return states(generator for _, generator in self.found)

    def refuse_moved(self, before: list[Any]) -> None:
        """Raise where a held generator's state differs from `before` (what `states()` gave)."""
        for (path, generator), state in zip(self.found, before, strict=True):
            if not _same(state, _state(generator)):
                kind = f"{type(generator).__module__.split('.')[0]} {type(generator).__name__}"
                raise ValueError(
                    f"unison: {path}, a {kind} the dataset holds, drew while items loaded: its draws "
                    "follow this process's past, not the item's position, so W processes would load other "
                    "items than one; draw from torch's, NumPy's or Python's global generators in "
                    "__getitem__ instead (unison seeds them per item)"
                )

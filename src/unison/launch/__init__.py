"""Launching: `unison launch` (the launcher and its helpers), the worker bootstrap, and `spawn`.

For example:

    # shell: unison launch --nproc 2 train.py      (or: python -m unison.launch --nproc 2 train.py)
    from unison.launch import spawn
    spawn(train, nprocs=2, args=(1e-3,))
    mp_spawn(main_worker, nprocs=2, args=(2, args))  # torch.multiprocessing.spawn's form
"""

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562), as in `unison/__init__.py`: `python -m unison.launch` imports
# this package first and must check its options before torch loads.
if TYPE_CHECKING:
    from unison.launch.spawn import SpawnError, mp_spawn, spawn

__all__ = ["SpawnError", "mp_spawn", "spawn"]


def __getattr__(name: str) -> Any:
    """`spawn`, `mp_spawn`, `SpawnError` from `unison.launch.spawn`, imported on first use."""
    if name not in __all__:
        raise AttributeError(f"module 'unison.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module("unison.launch.spawn"), name)
    globals()[name] = value
    return value

"""Launching: `unison launch` (the launcher and its helpers), the worker bootstrap, and `spawn`.

For example:

    # shell: unison launch --nproc 2 train.py      (or: python -m unison.launch --nproc 2 train.py)
    from unison.launch import spawn
    spawn(train, nprocs=2, args=(1e-3,))
    mp_spawn(main_worker, nprocs=2, args=(2, args))  # torch.multiprocessing.spawn's form
"""

from typing import TYPE_CHECKING

from unison.lazy import lazy_exports

# Loaded on first use (PEP 562), as in `unison/__init__.py`: `python -m unison.launch` imports
# this package first and must check its options before torch loads.
if TYPE_CHECKING:
    from unison.launch.spawn import SpawnError, mp_spawn, spawn

__all__ = ["SpawnError", "mp_spawn", "spawn"]
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "unison.launch.spawn"), globals())

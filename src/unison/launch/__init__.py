"""Launching: `unison launch` (the launcher and its helpers), the worker bootstrap, and `spawn`.

>>> # shell: unison launch --nproc 2 train.py      (or: python -m unison.launch --nproc 2 train.py)
>>> from unison.launch import spawn
>>> spawn(train, nprocs=2, args=(1e-3,))  # doctest: +SKIP
>>> mp_spawn(main_worker, nprocs=2, args=(2, args))  # torch.multiprocessing.spawn's form  # doctest: +SKIP
"""

from unison.launch.spawn import SpawnError, mp_spawn, spawn

__all__ = ["SpawnError", "mp_spawn", "spawn"]

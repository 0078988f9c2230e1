"""Seeding and RNG state: what makes two runs, or a run and its resume, identical."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch

from unison.env_names import CUBLAS_ENV


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed made from `parts`, the same in every process (unlike `hash`).

    >>> mix_seed(0, 3, "item") == mix_seed(0, 3, "item") != mix_seed(0, 4, "item")
    True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's CPU generators with `seed` (no GPU's: GPU dropout keeps
    its stream, unlike `torch.manual_seed`, which seeds every device's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


@contextmanager
def generators_kept(device: torch.device | None = None) -> Iterator[None]:
    """After the block, Python's, NumPy's and torch's CPU generators (and `device`'s, a GPU) are
    where they were before it, whatever was drawn or seeded inside.

    >>> a = torch.get_rng_state()
    >>> with generators_kept(): _ = torch.rand(3)
    >>> bool((torch.get_rng_state() == a).all())
    True
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    gpus = [device] if device is not None and device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=gpus):  # torch's CPU generator and the GPU's
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextmanager
def seeded_draws(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Inside the block, Python's, NumPy's and torch's CPU generators (and `device`'s, a GPU) start
    from `seed`; after it, each is where it was before (`generators_kept`). A random transform run
    inside draws as a function of `seed` alone, whichever process runs it and whatever that process
    drew before.

    >>> with seeded_draws(7): a = torch.rand(2), random.random()
    >>> with seeded_draws(7): b = torch.rand(2), random.random()
    >>> bool((a[0] == b[0]).all()) and a[1] == b[1]
    True
    """
    with generators_kept(device):
        seed_generators(seed)
        if device is not None and device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's generators (all CUDA devices too) on this process.

    `deterministic=True` also asks torch for deterministic kernels (slower on GPU) and sets
    `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS needs it, set before its first call, for
    deterministic matmuls on CUDA >= 10.2). Some CUDA ops have no deterministic kernel
    (`index_add_` backward, `scatter_add_` on some dtypes, `ctc_loss` backward...): they then raise
    a RuntimeError naming the op; pass `torch.use_deterministic_algorithms(True, warn_only=True)`
    yourself to only be warned.

    >>> set_seed(42); a = torch.rand(1); set_seed(42); bool(a == torch.rand(1))
    True
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"set_seed needs a non-negative int, got {seed!r}")
    seed_generators(seed)
    torch.manual_seed(seed)  # every GPU's generator too
    if deterministic:
        os.environ.setdefault(CUBLAS_ENV, ":4096:8")  # a user's own choice (":16:8") is kept
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def get_rng_state() -> dict[str, Any]:
    """Every generator's state on this process, as tensors and plain values (safe to save)."""
    py_version, py_state, py_gauss = random.getstate()
    # the legacy form, a tuple (numpy's stub types it as that tuple or the dict form)
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = legacy
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned, wherever its tensors were loaded (a checkpoint mapped
    to a GPU included: torch takes generator states as CPU byte tensors only).

    Where this process sees fewer GPUs than the one that saved, the first ones are restored.
    """
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np_keys = np_keys.cpu().numpy().astype(np.uint32)
    np.random.set_state((np_name, np_keys, np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(_cpu_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_cpu_bytes(cuda_state), index)


def _cpu_bytes(state: torch.Tensor) -> torch.Tensor:
    return state.to(device="cpu", dtype=torch.uint8)

"""Which device and backend a process trains on, and moving training state to that device.

The rules, as torchrun / Lightning / Accelerate apply them on GPUs:
- a launched process binds the GPU of its local rank (`CUDA_VISIBLE_DEVICES` already maps
  `--gpus 1,0` onto indices 0, 1 of this process), and fails with a clear message when the machine
  shows fewer GPUs than the launch has local processes (instead of every rank landing on cuda:0);
- `backend="gloo"` (or `UNISON_BACKEND=gloo`, set by `unison launch --backend gloo`) trains on the
  CPU even where CUDA exists;
- the model, the optimizer's state and the loss function's buffers move together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from unison.env_names import BACKEND_ENV, NVML_CHECK_ENV

BACKENDS = ("nccl", "gloo")


def resolve_backend(backend: str | None = None, cuda: bool | None = None) -> str:
    """`backend` if given, else `$UNISON_BACKEND`, else NCCL where CUDA is available and gloo otherwise.

    >>> resolve_backend("gloo")
    'gloo'
    """
    backend = backend or os.environ.get(BACKEND_ENV) or None
    if backend is None:
        return "nccl" if (torch.cuda.is_available() if cuda is None else cuda) else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() if cuda is None else cuda):
        raise ValueError("backend 'nccl' needs CUDA, and none is available here: use backend='gloo'")
    return backend


def check_local_rank(local_rank: int, device_count: int) -> int:
    """The CUDA index for `local_rank`, or a clear error when this process sees too few GPUs.

    A process shown exactly one GPU by its own `CUDA_VISIBLE_DEVICES` uses that one.

    >>> check_local_rank(1, 2)
    1
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if local_rank >= device_count == 1 and visible is not None and len(visible.split(",")) == 1:
        # Each process was given its own GPU (SLURM --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES):
        # its only one. (Two processes given the same one: NCCL refuses with "Duplicate GPU detected".)
        return 0
    if local_rank >= device_count:
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise RuntimeError(
            f"local rank {local_rank} needs GPU {local_rank} but this process sees {device_count} GPU(s)"
            f"{shown}: start at most {device_count} processes per machine (--nproc / --gpus), give each "
            "process its own GPU or all of them (SLURM: --gpus-per-task=1 or --gpus-per-node), or pass "
            "backend='gloo' to train on the CPU"
        )
    return local_rank


def pick_device(
    backend: str | None,
    cuda_id: int | None,
    local_rank: int,
    device_count: int,
    fallback: torch.device,
    force_cpu: bool = False,
) -> torch.device:
    """Where a process of a data-parallel job trains.

    `backend` is the live group's (None outside a launch), `cuda_id` the GPU asked for
    (`to_distributed(cuda_id)`), `fallback` where the model is now. An NCCL group trains on the GPU
    of its local rank (checked against `device_count`), a `cuda_id` on that GPU; gloo asked for
    (`force_cpu`) or no GPU at all keeps the model where it is.

    >>> pick_device("nccl", None, 1, 2, torch.device("cpu"))
    device(type='cuda', index=1)
    """
    if force_cpu or device_count == 0:
        return fallback
    if cuda_id is not None:
        return torch.device("cuda", cuda_id)
    if backend == "nccl":
        return torch.device("cuda", check_local_rank(local_rank, device_count))
    return fallback


def place_training_state(
    model: nn.Module, opt: torch.optim.Optimizer | None, loss_func: Any, device: torch.device
) -> None:
    """Move the model, the optimizer's state and the loss function's buffers to `device` together.

    For example:

        place_training_state(learn.model, learn.opt, learn.loss_func, torch.device("cuda", 0))
    """
    model.to(device)
    if opt is not None:
        move_optimizer_state(opt, device)
    move_loss_func(loss_func, device)


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of `opt`'s state to `device`, where its parameters now are.

    Needed after `model.to(device)` once the optimizer has state (a `learn.load` mapped to the CPU):
    torch's foreach steps refuse tensors on two devices. Scalar `step` counters stay on the CPU
    (torch keeps them there unless `capturable`).

        move_optimizer_state(learn.opt, torch.device("cuda", 0))
    """
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                state[key] = value.to(device)


def move_loss_func(loss_func: Any, device: torch.device) -> None:
    """Move a loss module's buffers (`CrossEntropyLoss(weight=...)`, `pos_weight`) to `device`, in place.

    For example:

        move_loss_func(nn.CrossEntropyLoss(weight=torch.ones(3)), torch.device("cuda", 0))
    """
    if isinstance(loss_func, nn.Module):
        loss_func.to(device)
    inner = getattr(loss_func, "func", None)  # a wrapper around a loss module (functools.partial-like)
    if isinstance(inner, nn.Module):
        inner.to(device)


@contextlib.contextmanager
def cuda_check_without_init() -> Iterator[None]:
    """Inside the block `torch.cuda.is_available()` asks NVML, which does not initialise CUDA.

    A process that forks workers must not initialise CUDA first ("Cannot re-initialize CUDA in
    forked subprocess"): torch's own check, `cudaGetDeviceCount`, does. torch's launcher calls
    `is_available()` too (`LaunchConfig`), so the whole fork path runs inside this block.
    """
    saved = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NVML_CHECK_ENV, None)
        else:
            os.environ[NVML_CHECK_ENV] = saved


def bf16_supported() -> bool:
    """True on a GPU with native bfloat16 (Ampere and later); pre-Ampere GPUs only emulate it, slowly."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it (dicts, lists, tuples) moved to the CPU.

    >>> to_cpu({"x": torch.ones(2)})["x"].device
    device(type='cpu')
    """
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_cpu(v) for v in obj)
    return obj

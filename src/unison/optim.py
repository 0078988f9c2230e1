"""Param groups and their learning rates: how `Learner` builds its optimizer and sets LRs.

A learner's `lr` is a float, a `slice(lo, hi)` (spread geometrically over the param groups that
`splitter(model)` makes, fastai's discriminative LRs) or a list (one per group). The ratios
between the groups' LRs, set by `opt_func` itself or by a slice or list, are kept by every later
float (`fit(lr=...)`, the one-cycle schedule).

>>> check_lr(slice(1e-4, 1e-2)); group_lrs(slice(1e-4, 1e-2), 3)
[0.0001, 0.001, 0.01]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from unison.learner_view import EngineHost

LR = float | slice | Sequence[float]


def check_lr(lr: LR) -> None:
    """A clear error for an LR that is not positive (a float, a slice's ends, a list's items)."""
    values = [lr.start, lr.stop] if isinstance(lr, slice) else lr if isinstance(lr, (list, tuple)) else [lr]
    for v in values:
        if v is None and isinstance(lr, slice):
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"learning rate must be a positive number, got {lr!r}")


def top_lr(lr: float | slice | Sequence[float]) -> float:
    """The largest LR that `lr` names (a slice's stop, a list's maximum)."""
    if isinstance(lr, slice):
        return float(lr.stop)
    if isinstance(lr, (list, tuple)):
        return float(max(lr))
    return float(cast(float, lr))


def group_lrs(
    lr: float | slice | Sequence[float], n_groups: int, ratios: Sequence[float] = ()
) -> list[float]:
    """One LR per param group for `lr`.

    >>> group_lrs(slice(1e-4, 1e-2), 3)
    [0.0001, 0.001, 0.01]
    >>> group_lrs(1e-2, 2, ratios=[0.1, 1.0])
    [0.001, 0.01]
    """
    if isinstance(lr, slice):
        hi = float(lr.stop)
        if lr.start is None:  # fastai: the last group at hi, the others at hi / 10
            return [hi / 10] * (n_groups - 1) + [hi]
        lo = float(lr.start)
        if n_groups == 1:
            return [hi]
        return [lo * (hi / lo) ** (i / (n_groups - 1)) for i in range(n_groups)]
    if isinstance(lr, (list, tuple)):
        if len(lr) != n_groups:
            raise ValueError(f"{len(lr)} learning rates given for {n_groups} param groups")
        return [float(v) for v in lr]
    ratios = list(ratios) if len(ratios) == n_groups else [1.0] * n_groups
    return [float(cast(float, lr)) * r for r in ratios]


def make_optimizer(
    model: nn.Module,
    raw_model: nn.Module,
    opt_func: Callable[..., torch.optim.Optimizer],
    lr: LR,
    splitter: Callable[[nn.Module], Sequence[Iterable[nn.Parameter]]] | None = None,
) -> tuple[torch.optim.Optimizer, list[float]]:
    """`opt_func(params, lr=top)` with one param group per part of `splitter(raw_model)` (the
    model without its wrappers), then each group's LR from `lr`; returns it and the groups' LR
    ratios."""
    if splitter is not None:
        params: Any = [{"params": list(part)} for part in splitter(raw_model)]
    else:
        params = model.parameters()
    top = top_lr(lr)
    opt = opt_func(params, lr=top)
    ratios = [group["lr"] / top for group in opt.param_groups]
    if not isinstance(lr, (int, float)):
        ratios = apply_lr(opt, lr, ratios)
    return opt, ratios


def apply_lr(opt: torch.optim.Optimizer, lr: LR, ratios: Sequence[float]) -> list[float]:
    """Set each param group's LR for `lr`; return the ratios a later float keeps (a slice or list
    sets new ones)."""
    lrs = group_lrs(lr, len(opt.param_groups), ratios)
    for group, group_lr in zip(opt.param_groups, lrs, strict=True):
        group["lr"] = group_lr
    return [v / max(lrs) for v in lrs] if not isinstance(lr, (int, float)) else list(ratios)


def schedule_length(scheduler: Any) -> tuple[str, int] | None:
    """How many steps a scheduler's schedule lasts, as it was built: OneCycleLR's `total_steps`,
    CosineAnnealingLR's `T_max`, PolynomialLR's `total_iters`, a Hugging Face schedule's
    `num_training_steps` (a `LambdaLR` over a `functools.partial`); None for any other.

    >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> schedule_length(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12))
    ('T_max', 12)
    """
    lr = torch.optim.lr_scheduler
    for kind, name in (
        (lr.OneCycleLR, "total_steps"),
        (lr.CosineAnnealingLR, "T_max"),
        (lr.PolynomialLR, "total_iters"),
    ):
        if isinstance(scheduler, kind):
            return name, int(getattr(scheduler, name))
    for function in getattr(scheduler, "lr_lambdas", ()):
        steps = getattr(function, "keywords", {}).get("num_training_steps")
        if steps is not None:
            return "num_training_steps", int(steps)
    return None


def refuse_a_schedule_of_the_loaders_batches(
    scheduler: Any, fit: str, host: EngineHost, batches: int | None, accumulate: int
) -> None:
    """On W > 1 processes each rank takes 1/W of a DataLoader's `batches`: a schedule whose length
    counts them (a per-process batch of the global one over W) would stop part way, where the same
    script on one process ends it. Refused in one line at the fit's training pass, before a step."""
    length, world, epochs, share = (
        schedule_length(scheduler),
        host.collective.world_size,
        host.n_epoch,
        host.n_iter,
    )
    if length is None or world == 1 or not share or not batches:
        return
    name, scheduled = length
    steps = epochs * math.ceil(share / accumulate)
    if scheduled != steps and scheduled in (epochs * batches, epochs * math.ceil(batches / accumulate)):
        raise ValueError(
            f"{fit}: the LR scheduler's {name}={scheduled} counts the DataLoader's batches ({batches} an "
            f"epoch), but on {world} processes each rank takes {share} of them: the fit takes {steps} "
            f"optimizer steps, and the schedule would stop part way; build it with {name}={steps} "
            "(epochs x ceil(len(dataset) / (batch_size x world_size)) / accumulate)"
        )

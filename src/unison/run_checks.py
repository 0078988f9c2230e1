"""What a `Run` refuses, each in one line naming the fix: a callback that drives the `Learner`'s own
loop, a loss it cannot count (`loss_terms`), a backward of anything but this batch's `run.loss`
computed by the model `run.setup` returned, a training call outside a `run.loader` pass, an LR
scheduler it was not given.

    total, count, mean = loss_terms(F.cross_entropy(out, y, reduction="none"), None, "sum")
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from unison.callbacks.schedule import LRFinder, OneCycleScheduler
from unison.callbacks.tracker import SaveModelCallback
from unison.callbacks.training import GradientAccumulation
from unison.losses import one_step_from, uncounted_items
from unison.run_host import RunHost

__all__ = [
    "averaged_wrapper_problem",
    "check_schedulers",
    "loss_terms",
    "refuse_learner_callback",
    "require_backward_of",
    "require_training_batch",
]


#: Callbacks that drive the `Learner`'s own loop, and what a `Run` uses instead.
_LEARNER_LOOP_CALLBACKS: dict[type, str] = {
    GradientAccumulation: "the own loop accumulates with Run(accumulate=k) (the callback's cancelled "
    "steps would lose their gradients at opt.zero_grad())",
    OneCycleScheduler: "it schedules the Learner's fit; give a torch scheduler (OneCycleLR, ...) to "
    "run.setup(model, opt, scheduler)",
    LRFinder: "it is the Learner's lr_find sweep",
    SaveModelCallback: "it saves through Learner.save; the own loop checkpoints with run.checkpoint(...)",
}


def refuse_learner_callback(cb: Any) -> None:
    """Refuse (one line) a callback that drives the `Learner`'s own loop, naming what a `Run` uses."""
    for kind, instead in _LEARNER_LOOP_CALLBACKS.items():
        if isinstance(cb, kind):
            raise ValueError(f"Run.add_cb({type(cb).__name__}): {instead}")


def loss_terms(
    value: Any, count: float | Tensor | None, reduction: str
) -> tuple[Tensor, float, Tensor | None]:
    """What `run.loss` was given, as `(sum, count, mean)` (the mean None unless given), checked:
    a loss averaged on each rank is refused (it weighs ranks, not items), as are per-item losses
    that leave targets out (`ignore_index`: their zeros would count as terms)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"Run.loss: give the loss as a tensor, got {type(value).__name__}")
    if value.dim() > 0 and count is None:
        uncounted = uncounted_items(value)
        if uncounted is not None:
            why, count_of = uncounted
            raise ValueError(
                f"Run.loss: these per-item losses {why}, so they are not one term each: pass the "
                f"sum and its count, run.loss(loss.sum(), count={count_of})"
            )
        value, count = value.sum(), value.numel()  # one term per element
    if count is None:
        raise ValueError(
            "Run.loss(loss, count=...): a loss already averaged on each rank is not exact (it weighs "
            "ranks, not items): pass the sum with count= (samples or tokens it sums), or per-item losses"
        )
    if reduction not in ("sum", "mean"):
        raise ValueError(f'Run.loss: reduction must be "sum" or "mean", got {reduction!r}')
    count = float(count.item() if isinstance(count, Tensor) else count)
    mean = value if reduction == "mean" else None
    total = value if reduction == "sum" else value.nan_to_num(0.0) * count  # (an empty share: 0)
    return total, count, mean


#: Why a loss computed from run.loss's is refused: a ported AMP or Accelerate loop's habits.
_CHANGED_LOSS = (
    '; it was changed after run.loss: for fp16, run.add_cb(unison.MixedPrecision("fp16")) scales it with '
    "its own GradScaler, and run.backward already divides by the global count (accumulation steps included)"
)


def require_backward_of(host: RunHost, loss: Any) -> None:
    """Refuse (one line) a `run.backward` of anything but this training batch's `run.loss`, computed by
    the model to train (`run.model`): a model called around it would leave DDP's averaging out."""
    require_training_batch(host, "Run.backward")
    if loss is not host.loss_grad or loss is None:
        raise RuntimeError(
            "Run.backward: give it what run.loss returned for this batch, unchanged: "
            "run.backward(run.loss(loss_sum, count=n)) (the gradient is made exact from its count)"
            + (_CHANGED_LOSS if one_step_from(loss, host.loss_grad) else "")
        )
    if not host.model_called and host.strategy is not None and host.raw_model is not host.model:
        raise RuntimeError(
            "Run.backward: this batch's loss was not computed by the model run.setup returned: "
            f"{type(host.model).__name__} averages the gradients over the ranks only through its own "
            "forward pass: call the model run.setup returned (model, opt = run.setup(model, opt)), not the "
            "one given to it"
        )


def require_training_batch(host: RunHost, what: str) -> None:
    """Refuse `what` (a training loss or backward) outside a batch of a `run.loader` training pass."""
    if host.training and host.in_batch:
        return
    if host.model is not None and host.model.training:
        raise RuntimeError(
            f"{what}: not in a pass over run.loader(dl): iterate what run.loader(dl) returns, not "
            "the DataLoader itself (unison shards it across processes and counts the steps)"
        )
    raise RuntimeError(f"{what}: not in a training pass: call model.train() before iterating run.loader(dl)")


def check_schedulers(
    host: RunHost, setup_lrs: list[Any] | None, components: dict[str, Any], run_opt: Any
) -> None:
    """Refuse a checkpoint of an LR that a torch scheduler unknown to unison moved: its state would
    not be saved, and a resume would restart its schedule. (A learning rate the loop sets itself,
    as nanoGPT's `get_lr(step)`, is a function of the step and resumes as it is.)"""
    if host.opt is None or setup_lrs is None:
        return
    known = [c for c in components.values() if getattr(c, "optimizer", None) is not None]
    known += [cb for cb in host.cbs if getattr(cb, "scheduler", None) is not None]  # LRSchedulerCallback
    if known:
        return
    groups = host.opt.param_groups
    # A torch scheduler built on the optimizer leaves its marks: `initial_lr`, a wrapped `step`.
    built = any("initial_lr" in g for g in groups) or any(
        hasattr(getattr(o, "step", None), "_wrapped_by_lr_sched") for o in (host.opt, run_opt)
    )
    moved = [(was, g["lr"]) for was, g in zip(setup_lrs, groups, strict=True) if g["lr"] != was]
    if built and moved:
        was, now = moved[0]
        raise ValueError(
            f"Run.checkpoint: an LR scheduler unison was not given moved the learning rate from {was:.3g} "
            f"to {now:.3g}: its state would not be saved and a resume would restart it; pass it to "
            "run.setup(model, opt, scheduler) and step the scheduler that returns"
        )


def averaged_wrapper_problem(obj: Any) -> str | None:
    """Why an `AveragedModel` cannot be checkpointed as registered: built on the DDP wrapper
    `run.setup` returned, its keys carry DDP's `module.` prefix, and a resume at another number
    of processes (no wrapper on one) would not find them."""
    if isinstance(obj, AveragedModel) and isinstance(obj.module, nn.parallel.DistributedDataParallel):
        return (
            "the AveragedModel averages the DDP wrapper run.setup returned, so its checkpoint would not "
            "load at another number of processes: build it as AveragedModel(run.model)"
        )
    return None

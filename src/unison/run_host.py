"""The own-loop `Run`'s side of the engine: `RunHost`, the state the strategies and callbacks see
(what `unison.learner_view.LearnerView` names, as the `Learner` has it), `RunLoader`, which fires
the batch events as your loop iterates, and `RunOptimizer`, which fires the step's.

The `Run` (`unison.run`) is the API; this is what it drives. They are two objects so that the
engine's names (`host.loss`, the batch's loss tensor) and the API's (`run.loss(...)`) never meet.

    host = RunHost(ParallelConfig(), accumulate=1, path=Path("."), model_dir=Path("models"))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader

import unison.engine as engine
from unison.callbacks.recorder import Recorder
from unison.data.drawn import DrawnOrder
from unison.data.stream import loader_length
from unison.distributed.strategy import ParallelConfig
from unison.events import (
    CancelBatchException,
    CancelTrainException,
    CancelValidException,
)
from unison.loop_host import LoopHost
from unison.optim import refuse_a_schedule_of_the_loaders_batches

__all__ = [
    "LoaderOrders",
    "RunHost",
    "RunLoader",
    "RunOptimizer",
    "RunScheduler",
    "track_steps",
]


class RunHost(LoopHost):
    """What the engine, the strategy and the callbacks read and set while a `Run` trains."""

    parallel_api = "Run"

    def __init__(self, config: ParallelConfig, accumulate: int, path: Path, model_dir: Path) -> None:
        self.config, self.accumulate = config, accumulate
        self.path, self.model_dir = path, model_dir
        super().__init__()  # opt, collective, strategy, epoch, iter, the batch, cbs, ...
        self.model = cast(nn.Module, None)  # (run.setup sets it before the engine reads it)
        self.opt_func: Any = None
        self.lr: Any = None
        self.loss_func: Callable[..., Any] | None = None  # the loop computes the loss; `run.loss` receives it
        self.metrics: list[Any] = []
        self.dls = SimpleNamespace(train=None, valid=None)
        self.call_model: Callable[[nn.Module, tuple[Any, ...]], Any] = lambda model, xb: model(*xb)
        self.recorder: Any = Recorder(print_table=False)  # (the fastai bridge hands its RecorderView)
        self.scheduler: Any = None  # the LR scheduler given to run.setup
        self.in_batch = False  # a batch was yielded and its after_batch has not run yet
        self.model_called = False  # the model to train ran a forward pass with grad in this batch
        self._called_hook: tuple[nn.Module, Any] | None = None

    def watch_model_calls(self) -> None:
        """Note each forward pass with grad of the strategy's wrapper (a model wrapped again has a
        new one): only DDP's own forward pass makes its backward average the gradients. The user's
        own model gets no hook (it stays picklable whole, `torch.save(model)`)."""
        if self._called_hook is not None and self._called_hook[0] is self.model:
            return
        if self._called_hook is not None:
            self._called_hook[1].remove()
            self._called_hook = None
        if self.model is self.raw_model:
            return
        handle = self.model.register_forward_pre_hook(lambda *_: self._note_call())
        self._called_hook = (self.model, handle)

    def _note_call(self) -> None:
        self.model_called = self.model_called or torch.is_grad_enabled()


#: What a pass sets that a training batch in flight needs back after an evaluation inside it
#: (besides the batch itself, a `BatchState` each batch replaces).
_PASS_STATE = ("dl", "training", "iter", "n_iter", "grad_sync", "in_batch", "batch")


class RunLoader:
    """One pass over this rank's share of a loader per `iter()`: a training pass while the model is
    in train mode (the epoch's order, no item twice, resumed mid-epoch), else an evaluation pass.
    Yields each batch on the model's device with padding rows removed; fires the batch events."""

    def __init__(self, host: RunHost, dl: DataLoader) -> None:
        self.host, self.dl = host, dl

    def __len__(self) -> int:
        host = self.host
        return loader_length(engine.shard_loader(host, self.dl, pad=False)) or 0

    def __iter__(self) -> Iterator[Any]:
        host = self.host
        assert host.model is not None
        training = host.model.training
        if host.in_batch and training:
            raise RuntimeError("Run: a training loader iterated inside a training batch (nested loops)")
        if training and host.opt is None:
            raise RuntimeError(
                "Run: a training pass needs an optimizer: run.setup(model, opt) (run.setup(model) evaluates "
                "only; call model.eval() before iterating)"
            )
        # An evaluation inside a training batch (nanoGPT's estimate_loss): the batch's state comes back.
        outer = {name: getattr(host, name) for name in _PASS_STATE} if host.in_batch else None
        start = engine.begin_pass(host, self.dl, training)  # mid-epoch after a resume
        if training:
            host.watch_model_calls()  # (after begin_pass: a layer unfrozen wraps the model again)
            refuse_a_schedule_of_the_loaders_batches(
                host.scheduler, f"run.epochs({host.n_epoch})", host, loader_length(self.dl), host.accumulate
            )
        dl = host.dl
        phase, cancel = ("train", CancelTrainException) if training else ("validate", CancelValidException)
        device = host.device
        try:
            host(f"before_{phase}")
            for i, batch in enumerate(dl, start=start):
                engine.at_batch(host, i)
                if training:
                    last = i + 1 == host.n_iter
                    host.grad_sync = (i + 1) % host.accumulate == 0 or last
                engine.prepare_batch(host, batch, i, device)  # padding trimmed
                if training:
                    engine.take_share(host)  # under torchft: this process's rows among the replicas
                try:
                    host("before_batch")
                except CancelBatchException:
                    self._end_batch(cancelled=True)
                    continue
                host.in_batch = True
                if training:  # (an evaluation inside a training batch leaves the batch's note as it was)
                    host.model_called = False
                yield host.xb[0]  # (as a callback left it: float64 under check-exact)
                while training and host.redo_step:  # its torchft commit failed: the same items again
                    host.redo_step = False
                    host("before_redo")
                    host.model_called = False
                    yield host.xb[0]  # this rank's new share of them (no after_batch for the failed one)
                self._end_batch(cancelled=False)
        except cancel:
            host(f"after_cancel_{phase}")
        except GeneratorExit:  # the loop broke out: leave DDP's no_sync, nothing else
            if host.strategy is not None and hasattr(host.strategy, "after_batch"):
                host.strategy.after_batch()
            host.grad_sync, host.in_batch, host.redo_step = True, False, False
            raise
        if outer is not None:
            host(f"after_{phase}")
            for name, value in outer.items():
                setattr(host, name, value)
            return
        host.grad_sync = True
        host(f"after_{phase}")

    def _end_batch(self, cancelled: bool) -> None:
        host = self.host
        host.in_batch = False
        monitor = getattr(host.strategy, "monitor", None)
        if monitor is not None:  # this rank's loop body is done: a rank stuck in its own is named
            monitor.progress(host, 3)
        try:
            if cancelled or getattr(host, "_batch_cancelled", False):
                host("after_cancel_batch")
            host("after_batch")
        finally:
            host._batch_cancelled = False  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Untaken:
    """What a pass that took no optimizer step leaves: the gradients' versions (any in-place change
    bumps them), each group's learning rate, and how often each registered `AveragedModel` averaged."""

    grads: list[int]
    lrs: list[float]
    averaged: dict[str, int]

    @classmethod
    def of(cls, groups: list[dict[str, Any]], components: dict[str, Any]) -> _Untaken:
        grads = [p.grad for group in groups for p in group["params"]]
        averaged = {name: int(c.n_averaged) for name, c in components.items() if isinstance(c, AveragedModel)}
        return cls([-1 if g is None else g._version for g in grads], [g["lr"] for g in groups], averaged)


class RunOptimizer(torch.optim.Optimizer):
    """The optimizer `Run.setup` returns: the real one (FSDP2 rebuilds it over the shards), whose
    `step` fires the step's events and is skipped on accumulation micro-steps, as `zero_grad` is.
    Everything else (`param_groups`, `state_dict`, LR schedulers) is the real optimizer's."""

    def __init__(self, host: RunHost, components: dict[str, Any]) -> None:  # (not torch's __init__:
        self._host, self._components = host, components  # it would make a second param list)
        self._stepped = False  # an optimizer step was taken since the last zero_grad
        self._held: _Untaken | None = None  # what a pass that took no step left

    def hold_untaken_step(self) -> None:
        """After a training batch's backward pass and its events: where it takes no optimizer step
        (an accumulation micro-batch, or a torchft pass whose vote failed), what nothing may change
        before the next backward pass (`refuse_a_changed_untaken_step`)."""
        host = self._host
        taken = host.grad_sync and not host.redo_step
        self._held = None if taken else _Untaken.of(self.param_groups, self._components)

    def refuse_a_changed_untaken_step(self) -> None:
        """Refuse (one line) what changed since a pass that took no optimizer step, as a plain loop
        that steps every k batches does at its steps only: a gradient changed in place (clipping the
        step's partial sum), a learning rate moved, a registered `AveragedModel` updated."""
        held, self._held = self._held, None
        if held is None:
            return
        now = _Untaken.of(self.param_groups, self._components)
        fix = "do it only when run.sync_gradients is True"
        if held.grads != now.grads:
            fix = "clip when run.sync_gradients is True, or use unison.GradientClip"
            what = "the gradient was changed in place (clip_grad_norm_ at every batch clips a partial sum)"
        elif held.lrs != now.lrs:
            was, lr = next((a, b) for a, b in zip(held.lrs, now.lrs, strict=True) if a != b)
            what = f"the learning rate moved from {was:.3g} to {lr:.3g} (a scheduler stepped at every batch)"
            fix = "give the scheduler to run.setup(model, opt, scheduler), which steps it at real steps only"
        elif held.averaged != now.averaged:
            name = next(k for k in held.averaged if held.averaged[k] != now.averaged[k])
            what = f"the registered {name} was updated"
        else:
            return
        raise RuntimeError(
            f"Run.backward: {what} after a pass that took no optimizer step (an accumulation "
            f"micro-batch, or a torchft pass whose vote failed): {fix}"
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self._host.opt is not None
        return self._host.opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        host = self._host
        if not host.training:
            self.optimizer.step()
            return
        if not host.grad_sync or host.redo_step:
            # An accumulation micro-step (the gradients add up until the step's last batch), or a
            # step whose torchft commit failed (its gradients were dropped; the loop does it again).
            return
        self._stepped = True  # (also when skipped: that step's gradients are done with)
        try:
            host("before_step")
            engine.optimizer_step(host)
            host("after_step")
        except CancelBatchException:  # a skipped step (on_nonfinite="skip"): after_batch still runs
            host._batch_cancelled = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients of the step just taken. In training, a call before the step's last
        batch is a no-op, whether it comes after `step()` or before the next backward: the
        accumulated gradients of a step in progress are never lost."""
        if self._host.training and not self._stepped:
            return
        self._stepped = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"RunOptimizer({self.optimizer!r})"


class RunScheduler:
    """The LR scheduler `Run.setup` returns: the user's, whose `step()` takes effect at real optimizer
    steps only (as `opt.step()` does): a no-op on accumulation micro-steps and in a torchft pass
    whose commit failed (the loop body runs again and steps then). Everything else is the scheduler's.

        model, opt, sched = run.setup(model, opt, sched); ...; opt.step(); sched.step()
    """

    def __init__(self, host: RunHost, scheduler: Any) -> None:
        self._host, self.scheduler = host, scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        host = self._host
        if host.training and (not host.grad_sync or host.redo_step):
            return
        if args or kwargs:  # ReduceLROnPlateau's metric
            _refuse_a_value_of_one_rank(host, args, kwargs)
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, optimizer, ...
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"RunScheduler({self.scheduler!r})"


def _refuse_a_value_of_one_rank(host: RunHost, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A scheduler stepped on a value (ReduceLROnPlateau's metric) must be given the same one on
    every rank: each rank's own validation loss would give each its own learning rate, and the
    replicas would drift apart. Every rank sees every rank's value, so all raise alike."""
    collective = host.collective
    if collective.world_size == 1:
        return
    mine = [a.tolist() if isinstance(a, Tensor) else a for a in (*args, *kwargs.values())]
    values = [repr(v) for v in collective.gather_objects(mine)]  # (repr: nan equals nan)
    other = next((rank for rank, v in enumerate(values) if v != values[0]), None)
    if other is not None:
        raise ValueError(
            f"sched.step(...): rank 0 gave {values[0]}, rank {other} {values[other]}: each rank would set "
            "its own learning rate; step it on a value every rank shares (a mean over run.gather(...) of "
            "the items' losses)"
        )


class LoaderOrders:
    """Each map-style loader's epoch orders as the loader itself draws them (`unison.data.drawn`),
    rank 0's generator states on every rank: a component of every checkpoint and torchft heal."""

    def __init__(self, host: RunHost) -> None:
        self.host = host
        self.orders: list[DrawnOrder] = []

    def add(self, dl: DataLoader) -> None:
        drawn = DrawnOrder(dl)
        drawn.load_state_dict(self.host.collective.broadcast_object(drawn.state_dict()))
        self.orders.append(drawn)
        self.host._shards.draw_from(dl, drawn)

    def state_dict(self) -> dict[str, Any]:
        return {"orders": [drawn.state_dict() for drawn in self.orders]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for drawn, saved in zip(self.orders, state["orders"], strict=False):
            drawn.load_state_dict(saved)
        self.host._shards.clear()  # the sharded loaders are made again, in the restored orders


def track_steps(opt: torch.optim.Optimizer) -> None:
    """Mark `opt.step` as a torch LR scheduler marks the optimizer it is built on (it checks that the
    optimizer stepped before it): for the optimizer FSDP2 rebuilds under a scheduler built before."""
    step = opt.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = tracked  # type: ignore[method-assign]

"""What callbacks and trainers see of the `Learner`: its state and the few calls they make.

Callbacks and trainers are given the learner as `self.learn`. Typing it with this protocol, not
the `Learner` class, keeps the import graph a tree: `learner.py` imports the callbacks and the
trainers, and none of them imports `learner.py` back. A type checker sees every name here.

>>> def after_batch(self) -> None:      # in a Callback: self.learn is a LearnerView
...     print(self.learn.epoch, self.learn.iter, float(self.learn.loss))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from unison.loop_state import BatchState


class LoopState(Protocol):
    """The learner's state a callback may read (and, where the loop allows it, set). The `Learner`
    declares it by subclassing this (its values are set by `unison.loop_host.LoopHost`)."""

    # what is trained, on what
    model: nn.Module
    opt: torch.optim.Optimizer | None
    loss_func: Callable[..., Any] | None
    opt_func: Callable[..., torch.optim.Optimizer]
    lr: Any
    metrics: list[Any]
    dls: Any
    path: Path
    model_dir: Path
    cbs: list[Any]
    call_model: Callable[[nn.Module, tuple[Any, ...]], Any]
    # where the loop is
    epoch: int
    n_epoch: int
    iter: int
    n_iter: int
    train_iter: int
    pct_train: float
    training: bool
    start_epoch: int
    start_iter: int
    dl: Any
    batch: BatchState  # the batch in flight; xb, yb, pred, loss, ... are its fields
    xb: tuple[Any, ...]
    yb: tuple[Any, ...]
    pred: Any
    loss: Tensor | None
    loss_grad: Tensor | None
    loss_count: float
    score: bool
    record_metrics: bool
    grad_sync: bool
    # the parts the loop is made of
    recorder: Any
    collective: Any
    exact_loss: Any
    scaler: torch.amp.GradScaler | None
    lr_finder: Any
    data_seed: int
    stream_resume_state: dict[str, Any] | None
    _empty_share: bool  # this rank has no rows in the current batch (its share of the last one)
    _padded_xb: tuple[Any, ...]  # the inputs before padding rows were trimmed (an empty share's forward)
    redo_step: bool  # a torchft step's vote failed: the loop's body runs again on its new share
    parallel_api: str  # "distrib_ctx" (the Learner) or "Run", as messages name the loop
    _shards: Any  # each loader's sharded form, kept across epochs (unison.data.sharding.LoaderShards)
    strategy: Any  # the parallel strategy (unison.distributed.strategy.Strategy), None outside one


class EngineHost(LoopState, Protocol):
    """What the engine, the strategies and the checkpoint see of a loop, the `Learner`'s or `Run`'s:
    its state (`LoopState`) and the calls they make."""

    @property
    def checkpoint_format(self) -> str: ...

    @property
    def raw_model(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    def __call__(self, event: str) -> None: ...
    def create_opt(self) -> torch.optim.Optimizer | None: ...
    def split_batch(self, batch: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]: ...
    def set_collective(self, collective: Any) -> None: ...
    def add_cb(self, cb: Any) -> Any: ...
    def remove_cb(self, cb: Any) -> Any: ...
    def get_cb(self, cls: type) -> Any: ...


class LearnerView(EngineHost, Protocol):
    """What callbacks see of the `Learner`: the engine's view (`EngineHost`) and the Learner's calls."""

    def fit(self, n_epoch: int, lr: Any = None, cbs: Iterable[Any] = (), resume: bool = False) -> None: ...
    def group_lrs(self, lr: float | slice | Sequence[float]) -> list[float]: ...
    def save(self, name: str | Path, with_opt: bool = True) -> Path: ...
    def load(self, name: str | Path, with_opt: bool = True, strict: bool = True) -> Any: ...
    def snapshot(self) -> dict[str, Any]: ...
    def restore(self, snap: dict[str, Any]) -> None: ...

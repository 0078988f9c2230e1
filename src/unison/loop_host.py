"""`LoopHost`: what both training loops, the `Learner` and the own loop's `RunHost`, are to the
engine, the strategies and the callbacks: the loop's state under the names of
`unison.learner_view.LoopState` (fastai's), the batch in flight kept in one `BatchState` that each
batch replaces, and the calls both loops make the same way (callbacks, events, the device, the
user's model without its wrappers, the collective and the data order's seed).

>>> host = LoopHost()
>>> host.batch = BatchState(xb=(1,), loss_count=2.0)
>>> host.xb, host.loss_count
((1,), 2.0)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from unison.data.sharding import LoaderShards
from unison.distributed.collective import Collective
from unison.engine import unwrap_model
from unison.events import Callback, attach_callback, detach_callback, fire
from unison.exact_loss import ExactLoss
from unison.learner_view import LoopState
from unison.loop_state import BatchState

__all__ = ["BatchState", "LoopHost"]

H = TypeVar("H", bound="LoopHost")


def _in_batch(name: str, doc: str) -> Any:
    """A loop attribute that is the current `BatchState`'s field `name` (`learn.xb` is `learn.batch.xb`)."""
    return property(
        lambda host: getattr(host.batch, name), lambda host, value: setattr(host.batch, name, value), doc=doc
    )


class LoopHost(LoopState):
    """The state and calls the `Learner` and `RunHost` share (see the module's docstring); before
    anything ran: one process, no batch, no strategy."""

    xb = _in_batch("xb", "The batch's inputs (a tuple), padding rows trimmed.")
    yb = _in_batch("yb", "The batch's targets (a tuple), padding rows trimmed.")
    _padded_xb = _in_batch("padded_xb", "The inputs as the loader gave them (an empty share's forward).")
    _empty_share = _in_batch("empty_share", "Whether this rank has no row of the batch.")
    pred = _in_batch("pred", "The model's output for `xb`.")
    loss = _in_batch("loss", "The batch's loss (its mean over `loss_count` terms).")
    loss_grad = _in_batch("loss_grad", "What the step backpropagates (the loss's sum over a constant).")
    loss_count = _in_batch("loss_count", "The loss's terms (samples, tokens) in this rank's batch.")

    #: How a user trains this loop on several processes, as messages name it.
    parallel_api = "distrib_ctx"

    def __init__(self) -> None:
        self.batch = BatchState()
        self.opt: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None  # set by MixedPrecision("fp16")
        # The data order of every epoch is a function of this seed (see DistributedDL), rank 0's in a job.
        self._data_seed = torch.initial_seed() % 2**63
        self.collective = Collective()
        self.strategy: Any = None  # DDP, FSDP2 or torchft while one is attached
        self.exact_loss = ExactLoss()  # reads (sum, count) and divides each step's gradient
        self._shards = LoaderShards()  # each loader's sharded form, kept across epochs
        self.grad_sync = True  # False on gradient-accumulation micro-steps (DDP's no_sync)
        self.record_metrics = self.score = True  # score False: forward passes only (get_preds)
        self.start_epoch = self.start_iter = 0
        self.stream_resume_state: dict[str, Any] | None = (
            None  # a stateful stream's state at a resume (`engine.start_at`)
        )
        self.epoch = self.n_epoch = self.iter = self.n_iter = self.train_iter = 0
        self.pct_train = 0.0
        self.training = False
        self.dl: Any = None
        self.lr_finder: Any = None  # set by lr_find
        # A step whose torchft commit vote failed is redone by the loop's body (`engine.commit_step`).
        self.redo_step = False
        self.cbs: list[Any] = []

    # ---- callbacks and events ------------------------------------------------------------
    def add_cb(self: H, cb: Callback | type[Callback]) -> H:
        """Attach a callback (an instance, or a class to instantiate with no arguments)."""
        attach_callback(self, cb)
        return self

    def add_cbs(self: H, cbs: Iterable[Callback | type[Callback]]) -> H:
        """Attach each of `cbs`."""
        for cb in cbs:
            attach_callback(self, cb)
        return self

    def remove_cb(self: H, cb: Callback | type[Callback]) -> H:
        """Detach a callback instance, or every callback of a class."""
        detach_callback(self, cb)
        return self

    def get_cb(self, cls: type) -> Any:
        """The first attached callback of class `cls`, if any."""
        return next((c for c in self.cbs if isinstance(c, cls)), None)

    def __call__(self, event: str) -> None:
        fire(self.cbs, event)

    def split_batch(self, batch: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """`(inputs, targets)` of a loaded batch as the loop's body gets them: the own loop's whole."""
        return (batch,), ()

    def create_opt(self) -> torch.optim.Optimizer | None:
        """Make the loop's optimizer (the `Learner`'s from its `opt_func`); the own loop is handed one."""
        raise RuntimeError("Run: the optimizer comes from run.setup(model, opt)")

    # ---- what the engine and the strategies read -----------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (batches are moved there)."""
        param = next(self.model.parameters(), None) if self.model is not None else None
        return param.device if param is not None else torch.device("cpu")

    @property
    def raw_model(self) -> nn.Module:
        """The user's model, without any parallel or compile wrapper."""
        return unwrap_model(self.model)

    @property
    def checkpoint_format(self) -> str:
        """ "dcp" while the model is sharded (every rank writes its shards), else "file" (rank 0 writes)."""
        return self.strategy.checkpoint_format if self.strategy is not None else "file"

    @property
    def data_seed(self) -> int:
        """The seed of every epoch's data order (with the epoch number); the same on all ranks."""
        return self._data_seed

    @data_seed.setter
    def data_seed(self, seed: int) -> None:
        self._data_seed = seed
        self._shards.clear()

    def set_collective(self, collective: Collective) -> None:
        """Use `collective` for sharding and reductions (the engine hands it a strategy's)."""
        self.collective = collective
        self._shards.clear()

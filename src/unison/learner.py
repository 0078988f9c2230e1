"""`Learner`: the training loop as a sequence of named events.

    fit
      before_fit
      for each epoch:
        before_epoch
          before_train      for each batch: before_batch, after_pred, after_loss,
                            before_backward, after_backward, before_step, after_step, after_batch
          after_train
          before_validate   for each batch: before_batch, after_pred, after_loss, after_batch
          after_validate
        after_epoch
      after_fit

A `Cancel*Exception` raised by a callback ends that stage early; `after_cancel_<stage>`
then `after_<stage>` still run. Distribution enters through two seams only: the
`Collective` (identity on one process) that shards loaders and reduces metric
state, and the model wrapper `DistributedTrainer` installs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from unison.callbacks.core import (
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
)
from unison.callbacks.progress import ProgressCallback
from unison.callbacks.recorder import Recorder
from unison.callbacks.schedule import LRFinder, OneCycleScheduler, lr_find
from unison.data.batch import DataLoaders, cat_padded, take_rows, tensors_in, to_device
from unison.data.loader import DistributedDL
from unison.distributed.collective import Collective
from unison.distributed.sharded import is_sharded
from unison.distributed.sharded_checkpoint import load_learner, save_learner
from unison.metrics import Metric, as_metric, batch_size_of
from unison.serialization import FORMAT_KEY, FORMAT_VERSION, atomic_save, check_state_fits, safe_load


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a `DataParallel` / `DistributedDataParallel` wrapper."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


class _PredsCollector(Callback):
    """Keeps each validation batch's predictions and targets (padding already dropped)."""

    order = 100

    def __init__(self) -> None:
        self.preds: list[Tensor] = []
        self.targets: list[Tensor] = []

    def after_loss(self) -> None:
        self.preds.append(self.learn.pred.detach())
        if self.learn.yb:
            self.targets.append(self.learn.yb[0].detach())


class Learner:
    """Trains `model` on `dls` with `loss_func`, driving callbacks at each named event.

    >>> learn = Learner(DataLoaders(train_dl, valid_dl), model, nn.CrossEntropyLoss(),
    ...                 metrics=[accuracy], lr=1e-3)
    >>> with learn.distrib_ctx():     # a no-op outside `unison launch`
    ...     learn.fit_one_cycle(3)
    >>> valid_loss, acc = learn.validate()
    """

    def __init__(
        self,
        dls: DataLoaders,
        model: nn.Module,
        loss_func: Callable[..., Tensor],
        opt_func: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        lr: float = 1e-3,
        metrics: Iterable[Metric | Callable[..., Any]] = (),
        cbs: Iterable[Callback | type[Callback]] = (),
        path: str | Path = ".",
        model_dir: str | Path = "models",
        n_inp: int = 1,
        default_cbs: bool = True,
    ):
        if not isinstance(dls, DataLoaders):
            raise TypeError(
                f"Learner: dls must be a unison.DataLoaders, got {type(dls).__name__} "
                "(wrap your loaders: DataLoaders(train_dl, valid_dl))"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"Learner: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_func is None or not callable(loss_func):
            raise TypeError(
                f"Learner: loss_func must be a callable(pred, *targets) returning the mean batch "
                f"loss, got {loss_func!r}"
            )
        if not callable(opt_func):
            raise TypeError(f"Learner: opt_func must be a callable(params, lr=lr), got {opt_func!r}")
        self._check_lr(lr)
        self.dls = dls
        self.model = model
        self.loss_func = loss_func
        self.opt_func = opt_func
        self.lr = lr
        self.metrics: list[Metric] = [as_metric(m) for m in metrics]
        self.path = Path(path)
        self.model_dir = Path(model_dir)
        self.n_inp = n_inp
        self.opt: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None  # set by MixedPrecision("fp16")
        # The data order of every epoch is a function of this seed (see DistributedDL).
        self._data_seed = torch.initial_seed() % 2**63
        self.collective = Collective()
        self.grad_sync = True  # False on gradient-accumulation micro-steps (DDP's no_sync)
        self.record_metrics = True
        self.start_epoch, self.start_iter = 0, 0
        self.epoch = self.n_epoch = self.iter = self.n_iter = self.train_iter = 0
        self.pct_train = 0.0
        self.training = False
        self.dl: DistributedDL | DataLoader | None = None
        self.xb: tuple[Any, ...] = ()
        self.yb: tuple[Any, ...] = ()
        self.pred: Any = None
        self.loss: Tensor | None = None
        self.loss_grad: Tensor | None = None
        self._sharded: dict[int, tuple[DataLoader, DistributedDL]] = {}
        self.lr_finder: LRFinder | None = None  # set by lr_find
        self.cbs: list[Callback] = []
        self.recorder = Recorder()
        if default_cbs:
            self.add_cbs([self.recorder, ProgressCallback()])
        self.add_cbs(cbs)

    # ---- callbacks -------------------------------------------------------------------
    def add_cb(self, cb: Callback | type[Callback]) -> Learner:
        """Attach a callback (an instance, or a class to instantiate with no arguments)."""
        if isinstance(cb, type):
            cb = cb()
        if not isinstance(cb, Callback):
            raise TypeError(f"add_cb: {cb!r} is not a unison Callback")
        cb.learn = self
        self.cbs.append(cb)
        self.cbs.sort(key=lambda c: c.order)
        return self

    def add_cbs(self, cbs: Iterable[Callback | type[Callback]]) -> Learner:
        for cb in cbs:
            self.add_cb(cb)
        return self

    def remove_cb(self, cb: Callback | type[Callback]) -> Learner:
        """Detach a callback instance, or every callback of a class."""
        if isinstance(cb, type):
            self.cbs = [c for c in self.cbs if not isinstance(c, cb)]
        elif cb in self.cbs:
            self.cbs.remove(cb)
        return self

    def get_cb(self, cls: type[Callback]) -> Callback | None:
        """The first attached callback of class `cls`, if any."""
        return next((c for c in self.cbs if isinstance(c, cls)), None)

    @contextlib.contextmanager
    def added_cbs(self, cbs: Iterable[Callback | type[Callback]]) -> Iterator[Learner]:
        """Callbacks attached for the duration of a `with` block."""
        added = [c() if isinstance(c, type) else c for c in cbs]
        self.add_cbs(added)
        try:
            yield self
        finally:
            for c in added:
                self.remove_cb(c)

    def __call__(self, event: str) -> None:
        for cb in list(self.cbs):
            handler = getattr(cb, event, None)
            if handler is not None:
                handler()

    def _with_events(self, body: Callable[[], None], stage: str, cancel: type[Exception]) -> None:
        try:
            self(f"before_{stage}")
            body()
        except cancel:
            self(f"after_cancel_{stage}")
        self(f"after_{stage}")

    # ---- the loop --------------------------------------------------------------------
    def fit(
        self, n_epoch: int, lr: float | None = None, cbs: Iterable[Callback] = (), resume: bool = False
    ) -> None:
        """Train for `n_epoch` epochs, validating after each.

        `resume=True` continues from the newest checkpoint a `Checkpoint` callback wrote.

        >>> learn.fit(3, lr=1e-3)
        """
        if not isinstance(n_epoch, int) or isinstance(n_epoch, bool) or n_epoch < 0:
            raise ValueError(f"fit: n_epoch must be a non-negative int, got {n_epoch!r}")
        if lr is not None:
            self._check_lr(lr)
        with self.added_cbs(cbs):
            if self.opt is None:
                self.create_opt()
            if lr is not None:
                self.set_lr(lr)
            self.n_epoch = n_epoch
            self.start_epoch, self.start_iter = 0, 0
            if resume:
                self._resume()
            assert self.opt is not None
            self.opt.zero_grad(set_to_none=True)
            self._with_events(self._do_fit, "fit", CancelFitException)

    def fit_one_cycle(
        self,
        n_epoch: int,
        lr_max: float | None = None,
        div: float = 25.0,
        div_final: float = 1e5,
        pct_start: float = 0.25,
        moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95),
        cbs: Iterable[Callback] = (),
        resume: bool = False,
    ) -> None:
        """`fit` with the one-cycle policy: LR warms up to `lr_max` then anneals; momentum mirrors it.

        >>> learn.fit_one_cycle(5, lr_max=3e-3)
        """
        if lr_max is not None:
            self._check_lr(lr_max)
        schedule = OneCycleScheduler(
            lr_max or self.lr, div=div, div_final=div_final, pct_start=pct_start, moms=moms
        )
        self.fit(n_epoch, cbs=[schedule, *cbs], resume=resume)

    def lr_find(
        self, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True
    ) -> float:
        """Sweep the LR exponentially, record the loss, restore the model; return a suggested LR."""
        return lr_find(self, start_lr=start_lr, end_lr=end_lr, num_it=num_it, stop_div=stop_div)

    def _do_fit(self) -> None:
        for epoch in range(self.start_epoch, self.n_epoch):
            self.epoch = epoch
            self._with_events(self._do_epoch, "epoch", CancelEpochException)

    def _do_epoch(self) -> None:
        self._do_epoch_train()
        self._do_epoch_validate()

    def _do_epoch_train(self) -> None:
        self.dl = self._shard(self.dls.train)
        self.training = True
        self.model.train()
        self._with_events(self._all_batches, "train", CancelTrainException)

    def _do_epoch_validate(self, dl: DataLoader | None = None) -> None:
        dl = dl if dl is not None else self.dls.valid
        if dl is None:
            return
        self.dl = self._shard(dl)
        self.training = False
        self.model.eval()
        with torch.no_grad():
            self._with_events(self._all_batches, "validate", CancelValidException)

    def _all_batches(self) -> None:
        assert self.dl is not None
        self.n_iter = len(self.dl)
        self._device = self.device
        self._devices_checked = False
        self._seen = 0
        start = 0
        if self.training and self.epoch == self.start_epoch and self.start_iter:
            start = self.start_iter
            if isinstance(self.dl, DistributedDL):
                self.dl.set_start(start)  # skip consumed batches without loading them
            self.start_iter = 0
        for i, batch in enumerate(self.dl, start=start):
            self.iter = i
            if self.training:
                self.train_iter = self.epoch * self.n_iter + self.iter
                self.pct_train = self.train_iter / max(1, self.n_epoch * self.n_iter)
            batch = to_device(batch, self._device, non_blocking=True)
            self._split_batch(batch)
            self.pred = self.loss = self.loss_grad = None  # a skipped batch must not report the last one
            self._with_events(self._do_one_batch, "batch", CancelBatchException)

    def _split_batch(self, batch: Any) -> None:
        if isinstance(batch, (list, tuple)):
            self.xb, self.yb = tuple(batch[: self.n_inp]), tuple(batch[self.n_inp :])
        else:
            self.xb, self.yb = (batch,), ()

    def _do_one_batch(self) -> None:
        if not self._devices_checked:
            self._check_devices()
        self.pred = self.model(*self.xb)
        if not self.training:
            self._drop_padding()
        self("after_pred")
        if not self.training and batch_size_of(self.xb) == 0:
            self.loss = self.loss_grad = torch.zeros((), device=self._device)
            return  # a batch made only of padding: nothing to score
        self.loss_grad = self.loss_func(self.pred, *self.yb)
        self.loss = self.loss_grad.detach()
        self("after_loss")
        if not self.training:
            return
        self("before_backward")
        if self.scaler is not None:
            self.scaler.scale(self.loss_grad).backward()
        else:
            self.loss_grad.backward()
        self("after_backward")
        self("before_step")
        assert self.opt is not None
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skipped when the scaled gradients overflowed
            self.scaler.update()
        else:
            self.opt.step()
        self("after_step")
        self.opt.zero_grad(set_to_none=True)

    def _drop_padding(self) -> None:
        """Trim the samples `DistributedDL` added to even out ranks: they must never be scored."""
        n_real = getattr(self.dl, "n_real", None)
        if n_real is None:
            return
        n = batch_size_of(self.xb)
        keep = max(0, min(n, n_real - self._seen))
        self._seen += n
        if keep < n:
            self.xb, self.yb, self.pred = (take_rows(v, keep) for v in (self.xb, self.yb, self.pred))

    def _check_devices(self) -> None:
        self._devices_checked = True
        if self._device.type == "meta":
            raise RuntimeError(
                "the model's parameters are on the meta device (no data): materialise it with "
                "model.to_empty(device=...) and initialise or load its weights before training"
            )
        for t in tensors_in((self.xb, self.yb)):
            if t.device != self._device:
                raise RuntimeError(
                    f"a batch tensor is on {t.device} but the model is on {self._device}: move the model "
                    "or stop moving the batch (the Learner moves batches to the model's device)"
                )

    def _shard(self, dl: DataLoader | DistributedDL) -> DataLoader | DistributedDL:
        """This rank's share of `dl` for the current epoch, in the order set by `data_seed`."""
        if isinstance(dl, DistributedDL):
            return dl
        world = self.collective.world_size
        if world == 1 and (isinstance(dl.dataset, IterableDataset) or dl.batch_size is None):
            return dl  # one process: a loader we cannot re-order is used as it is
        key = id(dl)
        if key not in self._sharded or self._sharded[key][0] is not dl:
            self._sharded[key] = (dl, DistributedDL(dl, self.collective.rank, world, seed=self.data_seed))
        sharded = self._sharded[key][1]
        sharded.set_epoch(self.epoch)
        return sharded

    @property
    def data_seed(self) -> int:
        """The seed of every epoch's data order (with the epoch number); the same on all ranks."""
        return self._data_seed

    @data_seed.setter
    def data_seed(self, seed: int) -> None:
        self._data_seed = seed
        self._sharded.clear()

    def set_collective(self, collective: Collective) -> None:
        """Use `collective` for sharding and reductions (`DistributedTrainer` calls this)."""
        self.collective = collective
        self._sharded.clear()

    # ---- evaluation ------------------------------------------------------------------
    def validate(self, dl: DataLoader | None = None) -> list[float]:
        """`[valid_loss, *metric_values]` over the whole of `dl` (default: the valid loader).

        Exact on any number of processes: padding is never scored and metric state,
        not per-batch averages, is reduced.
        """
        with self.added_cbs([] if self.recorder in self.cbs else [self.recorder]):
            self._do_epoch_validate(dl)
        return list(self.recorder.last_valid)

    def get_preds(self, dl: DataLoader | None = None) -> tuple[Tensor, Tensor | None]:
        """`(preds, targets)` for every sample of `dl` exactly once, in the loader's order, on every rank."""
        collector = _PredsCollector()
        self.record_metrics = False
        last_valid = self.recorder.last_valid
        try:
            with self.added_cbs([collector]):
                self._do_epoch_validate(dl)
        finally:
            self.record_metrics = True
            self.recorder.last_valid = last_valid  # get_preds is not a validation: keep its values
        preds = self.collective.gather_ordered(cat_padded(collector.preds))
        targets = self.collective.gather_ordered(cat_padded(collector.targets)) if collector.targets else None
        return preds, targets

    # ---- optimizer and state ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (batches are moved there)."""
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def raw_model(self) -> nn.Module:
        """The user's model, without any parallel wrapper."""
        return unwrap_model(self.model)

    def create_opt(self) -> torch.optim.Optimizer:
        self.opt = self.opt_func(self.model.parameters(), lr=self.lr)
        return self.opt

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr

    @staticmethod
    def _check_lr(lr: float) -> None:
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
            raise ValueError(f"learning rate must be a positive number, got {lr!r}")

    def model_file(self, name: str | Path) -> Path:
        """Where `save(name)` writes: `path/model_dir/name.pth` (a path with a suffix is used as is)."""
        name = Path(name)
        if name.suffix:
            return name if name.is_absolute() else self.path / self.model_dir / name
        return self.path / self.model_dir / f"{name}.pth"

    def save(self, name: str | Path, with_opt: bool = True) -> Path:
        """Write model (and optimizer) state to `path/model_dir/name.pth` atomically; rank 0 writes.

        >>> learn.save("stage1")
        PosixPath('models/stage1.pth')
        """
        file = self.model_file(name)
        if is_sharded(self.model):  # every rank writes its own shards: name.dcp
            return save_learner(self, file, with_opt)
        if self.collective.is_main:
            state: dict[str, Any] = {
                FORMAT_KEY: FORMAT_VERSION,
                "kind": "model",
                "model": self.raw_model.state_dict(),
            }
            if with_opt and self.opt is not None:
                state["opt"] = self.opt.state_dict()
            atomic_save(state, file)
        self.collective.barrier()  # nobody reads the file before it is complete
        return file

    def load(self, name: str | Path, with_opt: bool = True, strict: bool = True) -> Learner:
        """Load what `save` wrote, mapped to this process's device; checked before anything changes."""
        file = self.model_file(name)
        if load_learner(self, file, with_opt):  # a sharded save, or a sharded learner
            return self
        state = safe_load(file, map_location=self.device, kind="model")
        if strict:
            check_state_fits(self.raw_model, state["model"], file)
        self.raw_model.load_state_dict(state["model"], strict=strict)
        if with_opt and "opt" in state:
            if self.opt is None:
                self.create_opt()
            assert self.opt is not None
            self.opt.load_state_dict(state["opt"])
        return self

    def _resume(self) -> None:
        from unison.callbacks.checkpoint import Checkpoint

        ckpt = self.get_cb(Checkpoint)
        if not isinstance(ckpt, Checkpoint):
            raise ValueError(
                "fit(resume=True) needs a Checkpoint callback (cbs=[Checkpoint()]) that says "
                "where checkpoints are"
            )
        ckpt.restore_latest()  # no checkpoint yet: start fresh

    def snapshot(self) -> dict[str, Any]:
        """Deep copies of the model and optimizer state, for `restore` (kept in memory)."""
        return {
            "model": copy.deepcopy(self.raw_model.state_dict()),
            "opt": copy.deepcopy(self.opt.state_dict()) if self.opt is not None else None,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(snap["model"])
        if snap["opt"] is not None and self.opt is not None:
            self.opt.load_state_dict(snap["opt"])

    # ---- parallel and distributed ----------------------------------------------------
    def to_parallel(self, device_ids: Sequence[int] | None = None) -> Learner:
        """Train with single-process `DataParallel` over `device_ids` (all GPUs by default)."""
        from unison.distributed.trainer import ParallelTrainer

        trainer = ParallelTrainer(device_ids)
        self.add_cb(trainer)
        trainer.setup()
        return self

    def detach_parallel(self) -> Learner:
        """Undo `to_parallel`: the model is unwrapped again."""
        from unison.distributed.trainer import ParallelTrainer

        for cb in [c for c in self.cbs if isinstance(c, ParallelTrainer)]:
            cb.restore()
            self.remove_cb(cb)
        return self

    @contextlib.contextmanager
    def parallel_ctx(self, device_ids: Sequence[int] | None = None) -> Iterator[Learner]:
        """`to_parallel` for the duration of a `with` block."""
        self.to_parallel(device_ids)
        try:
            yield self
        finally:
            self.detach_parallel()

    def to_distributed(
        self,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        shard: bool = False,
        **ddp_kwargs: Any,
    ) -> Learner:
        """Train data-parallel across the processes of a launch (joins or makes the process group).

        `shard=True` shards weights, gradients and optimizer state (FSDP2, see `ShardedTrainer`,
        whose options `ddp_kwargs` then are).

        >>> learn.to_distributed(local_rank())   # seed 002's style; prefer distrib_ctx
        """
        from unison.distributed.sharded import ShardedTrainer
        from unison.distributed.trainer import DistributedTrainer

        kind = ShardedTrainer if shard else DistributedTrainer
        trainer = kind(cuda_id, sync_bn=sync_bn, timeout=timeout, **ddp_kwargs)
        self.add_cb(trainer)
        try:
            trainer.setup()
        except BaseException:
            self.remove_cb(trainer)
            raise
        return self

    def detach_distributed(self) -> Learner:
        """Undo `to_distributed`: model, BatchNorm, loaders and logging as they were."""
        from unison.distributed.sharded import ShardedTrainer
        from unison.distributed.trainer import DistributedTrainer

        for cb in [c for c in self.cbs if isinstance(c, (DistributedTrainer, ShardedTrainer))]:
            cb.restore()
            self.remove_cb(cb)
        return self

    @contextlib.contextmanager
    def distrib_ctx(
        self,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        shard: bool = False,
        **ddp_kwargs: Any,
    ) -> Iterator[Learner]:
        """`to_distributed` for the duration of a `with` block; a plain run outside a launch.

        >>> with learn.distrib_ctx():          # or distrib_ctx(shard=True): FSDP2
        ...     learn.fit(3)
        """
        from unison.distributed.sharded import ShardedTrainer
        from unison.distributed.trainer import DistributedTrainer

        self.to_distributed(cuda_id, sync_bn=sync_bn, timeout=timeout, shard=shard, **ddp_kwargs)
        try:
            yield self
        except Exception as exc:
            # A collective that failed because another rank stopped: say which one.
            trainer = self.get_cb(ShardedTrainer) if shard else self.get_cb(DistributedTrainer)
            stalled = (
                trainer.diagnose() if isinstance(trainer, (DistributedTrainer, ShardedTrainer)) else None
            )
            if stalled is not None:
                raise stalled from exc
            raise
        finally:
            self.detach_distributed()

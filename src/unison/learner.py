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
then `after_<stage>` still run. The learner is one client of `unison.engine` (the own-loop
`unison.Run` is the other): the strategy `distrib_ctx` attaches (DDP, FSDP2, torchft), each
loader's rank share, a batch's padding trimmed from its inputs, every loss read as a sum and a
count and the step's gradient divided by the global count, so W processes equal one process.
The rest is a one-line door: `unison.optim`, `unison.checkpoint.learner_files`, `unison.predictions`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import unison.engine as engine
from unison.callbacks.defaults import default_callbacks
from unison.callbacks.exactness_probe import attach_if_checking
from unison.callbacks.nonfinite import Mode
from unison.callbacks.preemption import OnPreempt, handling
from unison.callbacks.recorder import Recorder
from unison.callbacks.schedule import OneCycleScheduler, lr_find
from unison.checkpoint import learner_files
from unison.data.batch import (
    DataLoaders,
    call_model,
    split_batch,
    take_rows,
)
from unison.data.ranked import RankShardedLoader
from unison.data.stream import check_stream_split
from unison.distributed.strategy import ParallelConfig
from unison.events import (
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
    attached_callbacks,
)
from unison.learner_checks import check_devices, check_fit_args, check_learner_args
from unison.loop_host import LoopHost
from unison.losses import SummedLoss
from unison.metrics import Metric, as_metrics
from unison.optim import apply_lr, check_lr, group_lrs, make_optimizer
from unison.predictions import collect_preds, predict_item


class Learner(LoopHost):
    """Trains `model` on `dls` with `loss_func`, driving callbacks at each named event.

        learn = Learner(DataLoaders(train_dl, valid_dl), model, nn.CrossEntropyLoss(),
                        metrics=[accuracy], lr=1e-3)
        with learn.distrib_ctx():     # a no-op outside `unison launch`
            learn.fit_one_cycle(3)
        valid_loss, acc = learn.validate()

    `loss_func=None`: the model's own loss; `splitter` makes param groups; `call_model(model, xb)`:
    how inputs reach the model; `compile=True` (or `torch.compile` options). `steps_per_epoch` bounds
    a training epoch over a stream; `stream_split="by_node"`: a Hugging Face stream reads 1/W per rank
    (not exact). `on_preempt`: SIGTERM / SIGUSR1 stop every rank at one step, checkpointed, exit 75
    ("requeue": also requeue the SLURM job; None: Python's default; `unison.callbacks.preemption`).
    """

    opt: torch.optim.Optimizer | None  # made by create_opt (fit); None before

    def __init__(
        self,
        dls: DataLoaders,
        model: nn.Module,
        loss_func: Callable[..., Tensor | SummedLoss] | None = None,
        opt_func: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        lr: float | slice | Sequence[float] = 1e-3,
        metrics: Iterable[Metric | Callable[..., Any]] | Metric | Callable[..., Any] = (),
        cbs: Iterable[Callback | type[Callback]] = (),
        path: str | Path = ".",
        model_dir: str | Path = "models",
        n_inp: int = 1,
        default_cbs: bool = True,
        splitter: Callable[[nn.Module], Sequence[Iterable[nn.Parameter]]] | None = None,
        call_model: Callable[[nn.Module, tuple[Any, ...]], Any] = call_model,
        compile: bool | dict[str, Any] = False,
        steps_per_epoch: int | None = None,
        stream_split: str = "exact",
        on_nonfinite: Mode | None = "stop",
        on_preempt: OnPreempt | None = "stop",
    ):
        check_learner_args(dls, model, loss_func, opt_func, lr, steps_per_epoch)
        self.dls = dls
        self.steps_per_epoch = steps_per_epoch
        self.stream_split = check_stream_split(stream_split)
        # torch.compile'd once here; DDP later wraps the compiled module. Files keep the plain keys.
        compiled = torch.compile(model, **({} if compile is True else compile)) if compile else model
        self.model = cast(nn.Module, compiled)  # torch.compile of a module: a module (stubs: Callable)
        self.loss_func = loss_func
        self.opt_func = opt_func
        self.lr = lr
        self.metrics: list[Metric] = as_metrics(metrics)
        self.splitter = splitter
        self.call_model = call_model  # how a batch's inputs reach the model: the one place to change it
        self._lr_ratios: list[float] = []
        self.path = Path(path)
        self.model_dir = Path(model_dir)
        self.n_inp = n_inp
        LoopHost.__init__(self)  # opt, collective, strategy, epoch, iter, the batch, cbs, ...
        self.recorder = Recorder()
        if default_cbs:  # recorder, progress bars, non-finite check, preemption (callbacks/defaults.py)
            self.add_cbs(default_callbacks(self.recorder, on_nonfinite, on_preempt))
        self.add_cbs(cbs)
        attach_if_checking(self)  # only under `unison check-exact`: records the first steps

    @contextlib.contextmanager
    def added_cbs(self, cbs: Iterable[Callback | type[Callback]]) -> Iterator[Learner]:
        """Callbacks attached for the duration of a `with` block."""
        with attached_callbacks(self, cbs):
            yield self

    def _with_events(self, body: Callable[[], None], stage: str, cancel: type[Exception]) -> None:
        try:
            self(f"before_{stage}")
            body()
        except cancel:
            self(f"after_cancel_{stage}")
        self(f"after_{stage}")

    # ---- the loop --------------------------------------------------------------------
    def fit(
        self,
        n_epoch: int,
        lr: float | slice | Sequence[float] | None = None,
        cbs: Iterable[Callback] = (),
        resume: bool = False,
    ) -> None:
        """Train for `n_epoch` epochs, validating after each. `lr`: every param group's LR keeping their
        ratios (a float), spread geometrically (`slice(lo, hi)`), or one per group (a list); None:
        `learn.lr`, whatever LR an earlier fit's schedule left. `resume=True` continues from the newest
        checkpoint a `Checkpoint` callback wrote: `learn.fit(3, lr=1e-3)`, `learn.fit(10, resume=True)`.
        """
        check_fit_args(self, n_epoch, lr, cbs)
        with self.added_cbs(cbs), handling(self):  # preemption signals, handled while fit runs
            if self.opt is None:
                self.create_opt()
            # Every fit starts at its LR (fastai's too): an earlier schedule leaves its last one behind.
            self.set_lr(self.lr if lr is None else lr)
            engine.start_fit(self, n_epoch, learner_files.resume(self) if resume else None)
            assert self.opt is not None
            self.opt.zero_grad(set_to_none=True)
            self._with_events(self._do_fit, "fit", CancelFitException)

    def fit_one_cycle(
        self,
        n_epoch: int,
        lr_max: float | slice | Sequence[float] | None = None,
        div: float = 25.0,
        div_final: float = 1e5,
        pct_start: float = 0.25,
        moms: tuple[float, float, float] | None = (0.95, 0.85, 0.95),
        cbs: Iterable[Callback] = (),
        resume: bool = False,
    ) -> None:
        """`fit` with the one-cycle policy: LR warms up to `lr_max` then anneals; momentum mirrors it.
        Each param group follows its own cycle: `lr_max` as in `fit(lr=...)` (`slice(1e-5, 1e-3)`):
        `learn.fit_one_cycle(5, lr_max=3e-3)`.
        """
        if lr_max is not None:
            check_lr(lr_max)
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
        self._start = engine.begin_pass(self, self.dls.train, True, self.steps_per_epoch, self.stream_split)
        self.model.train()
        self._with_events(self._all_batches, "train", CancelTrainException)

    def _do_epoch_validate(self, dl: DataLoader | None = None) -> None:
        dl = dl if dl is not None else self.dls.valid
        if dl is None:
            return
        self._start = engine.begin_pass(self, dl, False)
        self.model.eval()
        with torch.no_grad():
            self._with_events(self._all_batches, "validate", CancelValidException)

    def _all_batches(self) -> None:
        assert self.dl is not None
        self._device = self.device
        self._devices_checked = False
        for i, batch in enumerate(self.dl, start=self._start):
            engine.at_batch(self, i)
            engine.prepare_batch(self, batch, i, self._device)  # padding trimmed
            engine.take_share(self)  # under torchft: this process's rows among the replicas
            self._with_events(self._do_one_batch, "batch", CancelBatchException)

    def _do_one_batch(self) -> None:
        if not self._devices_checked:
            check_devices(self._device, (self.xb, self.yb))
            self._devices_checked = True
        if not self._score_batch():
            return
        while not engine.commit_step(self):  # torchft: summed over the replicas and voted
            self.redo_step = False  # the vote failed: the step again, on this process's new share
            self("before_redo")
            self._score_batch()
        self("after_backward")
        self("before_step")
        engine.optimizer_step(self)
        self("after_step")
        assert self.opt is not None  # fit made it
        self.opt.zero_grad(set_to_none=True)

    def _score_batch(self) -> bool:
        """The forward pass over `xb`, then its loss and, in training, its backward pass; False
        where the batch ends before the backward pass (evaluation, or no loss to compute)."""
        if self._empty_share and not self.training:
            # Nothing to score here, but the forward pass keeps every collective in step (a sharded
            # model gathers its weights) and gives the output's structure, with no rows.
            self.pred = take_rows(self.call_model(self.model, self._padded_xb), 0)
        else:
            self.pred = self.call_model(self.model, self.xb)
        self("after_pred")
        if not self.score or (self._empty_share and not self.training):
            return False
        engine.score(self, *self.exact_loss.terms(self))  # the loss as a sum and a count
        self("after_loss")
        if not self.training:
            return False
        self("before_backward")
        engine.backward(self)  # then the gradient of the global batch, at a step's last micro-batch
        return True

    def _shard(self, dl: Any, pad: bool = True) -> DataLoader | RankShardedLoader:
        """This rank's share of `dl` this epoch (`unison.engine.shard_loader`); `pad=False` in training."""
        return engine.shard_loader(self, dl, pad, self.steps_per_epoch, self.stream_split)

    def split_batch(self, batch: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """`(inputs, targets)` of a batch: its first `n_inp` items are inputs (`data.batch.split_batch`)."""
        return split_batch(batch, self.n_inp)

    # ---- evaluation ------------------------------------------------------------------
    def validate(self, dl: DataLoader | None = None) -> list[float]:
        """`[valid_loss, *metric_values]` over the whole of `dl` (default: the valid loader); exact on
        any number of processes (padding never scored; metric state, not batch averages, reduced)."""
        with self.added_cbs([] if self.recorder in self.cbs else [self.recorder]):
            self._do_epoch_validate(dl)
        return list(self.recorder.last_valid)

    def get_preds(
        self, dl: DataLoader | None = None, with_loss: bool = False, pad_value: float = -100
    ) -> tuple[Any, ...]:
        """`(preds, targets)` for every sample of `dl` exactly once, in the loader's order, on every rank.
        `preds` keeps the model's output structure (tensor, tuple, dict, `ModelOutput`; a batch's scalar
        `loss` becomes None); targets are None for an unlabelled loader; variable-length outputs are
        padded with `pad_value`. `with_loss=True`: `(preds, targets, losses)`, `reduction="none"`'s.

            logits, labels = learn.get_preds()
            out, _ = hf_learn.get_preds(); out.logits.shape
        """
        return collect_preds(self, lambda: self._do_epoch_validate(dl), with_loss, pad_value)

    def predict(self, item: Any, batched: bool = False) -> Any:
        """The model's output for one dataset item (collated as the loaders do), or a small batch
        (`batched=True`); on this process only, in eval mode, without gradients.

            learn.predict(valid_ds[0])           # one item: no batch dimension
            learn.predict(xb, batched=True)      # a batch as a loader yields it
        """
        loader = self.dls.valid if self.dls.valid is not None else self.dls.train
        return predict_item(self.raw_model, loader.collate_fn, item, batched, self.n_inp, self.call_model)

    # ---- optimizer and state ---------------------------------------------------------
    def create_opt(self) -> torch.optim.Optimizer:
        """`opt_func(params, lr=...)`, one param group per part of `splitter(model)` if given; the
        ratios of the groups' LRs are kept by `fit(lr=...)` and by every scheduler."""
        self.opt, self._lr_ratios = make_optimizer(
            self.model, self.raw_model, self.opt_func, self.lr, self.splitter
        )
        return self.opt

    def group_lrs(self, lr: float | slice | Sequence[float]) -> list[float]:
        """Each param group's LR for `lr` (a float keeps the groups' ratios; see `fit`)."""
        assert self.opt is not None
        return group_lrs(lr, len(self.opt.param_groups), self._lr_ratios)

    def set_lr(self, lr: float | slice | Sequence[float]) -> None:
        """Set each param group's LR (see `fit`); a slice or list also sets the ratios a later float keeps."""
        self.lr = lr
        if self.opt is not None:
            self._lr_ratios = apply_lr(self.opt, lr, self._lr_ratios)

    def model_file(self, name: str | Path) -> Path:
        """Where `save(name)` writes: `path/model_dir/name.pth` (a path with a suffix is used as is)."""
        return learner_files.model_file(self, name)

    def save(self, name: str | Path, with_opt: bool = True) -> Path:
        """Write model (and optimizer) state to `path/model_dir/name.pth` atomically; rank 0 writes.
        `learn.save("stage1")` writes `models/stage1.pth` and returns that path.
        """
        return learner_files.save(self, name, with_opt)

    def load(self, name: str | Path, with_opt: bool = True, strict: bool = True) -> Learner:
        """Load what `save` wrote, mapped to this process's device; checked before anything changes."""
        learner_files.load(self, name, with_opt, strict)
        return self

    def snapshot(self) -> dict[str, Any]:
        """Deep copies of the model and optimizer state, for `restore` (kept in memory)."""
        return learner_files.snapshot(self)

    def restore(self, snap: dict[str, Any]) -> None:
        learner_files.restore(self, snap)

    # ---- parallel and distributed (unison.engine, unison.distributed.strategy) ----------
    def to_parallel(self, device_ids: Sequence[int] | None = None) -> Learner:
        """Train with single-process `DataParallel` over `device_ids` (all GPUs by default)."""
        engine.to_parallel(self, device_ids)
        return self

    def detach_parallel(self) -> Learner:
        """Undo `to_parallel`: the model is unwrapped again."""
        engine.detach_parallel(self)
        return self

    @contextlib.contextmanager
    def parallel_ctx(self, device_ids: Sequence[int] | None = None) -> Iterator[Learner]:
        """`to_parallel` for the duration of a `with` block."""
        with contextlib.ExitStack() as undo:
            undo.callback(self.to_parallel(device_ids).detach_parallel)
            yield self

    def to_distributed(
        self,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        backend: str | None = None,
        shard: bool = False,
        **ddp_kwargs: Any,
    ) -> Learner:
        """Train data-parallel across the processes of a launch (joins or makes the process group), with
        the strategy `unison.distributed.strategy.ParallelConfig` makes of the arguments: DDP, FSDP2
        (`shard=True`: `ddp_kwargs` are `ShardedTrainer`'s), torchft (`fault_tolerant=True`). A script
        that made its group: `learn.to_distributed(local_rank())`; prefer `distrib_ctx`.
        """
        engine.attach_strategy(
            self, ParallelConfig.from_arguments(cuda_id, sync_bn, timeout, backend, shard, **ddp_kwargs)
        )
        return self

    def detach_distributed(self) -> Learner:
        """Undo `to_distributed`: model, BatchNorm, loaders and logging as they were."""
        engine.detach_strategy(self)
        return self

    @contextlib.contextmanager
    def distrib_ctx(self, *args: Any, **kwargs: Any) -> Iterator[Learner]:
        """`to_distributed(*args, **kwargs)` for the duration of a `with` block; a plain run outside a
        launch. A collective that failed because another rank stopped raises `RankStalledError` naming it.

            with learn.distrib_ctx():          # or distrib_ctx(shard=True): FSDP2
                learn.fit(3)
        """
        self.to_distributed(*args, **kwargs)
        try:
            yield self
        except Exception as exc:
            engine.name_stalled_rank(self, exc)
            raise
        finally:
            self.detach_distributed()

"""The fastai bridge: a stock fastai `Learner` driven through unison's engine.

fastai keeps its own loop (`Learner.fit`, its callbacks, recorder, metrics, progress); two fastai
callbacks carry its events to an engine host (`unison.run_host.RunHost`, the host the own-loop
`Run` uses), so the guarantees come from the engine's own parts, never a second copy:

- the strategy (`unison.engine.attach_strategy`: DDP, unison's exact sync BatchNorm on CPU too,
  the rank monitor that names a stalled rank);
- the data: each pass's loader becomes this rank's share (`RankShardedFastaiDL`), in the order
  fastai's own shuffle deals one process, planned by `unison.data.plan`;
- the loss: each training batch's mean is read as a sum and a count and divided by the engine's
  `ExactLoss`, so the step's gradient is one process's at the global batch (uneven last batch
  included); the recorded loss is the global batch's;
- evaluation: each validation batch's predictions and targets are gathered from every rank in
  data order, padding dropped (`Collective.gather_ordered`), before fastai computes the loss and
  its metrics: every rank scores the global batch, each item once;
- `NonFiniteCheck` (the first non-finite loss or gradient stops every rank, naming it) and
  `unison check-exact`'s probe run as engine callbacks at fastai's events.

fastai's own gathers (`maybe_gather`, which reads `WORLD_SIZE`) would gather these rows a second
time: while the bridge is attached on W > 1 processes, `WORLD_SIZE` reads 1 in this process
(restored on detach). Rank 0 alone shows progress and logs (fastai's own rule for `distrib_ctx`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import fastai.callback.core as fastai_core
import torch
from fastcore.basics import noop
from fastcore.foundation import L

import unison.engine as engine
import unison.events as unison_events
import unison.fastai.files as files
from unison.callbacks.exactness_probe import attach_if_checking
from unison.callbacks.nonfinite import NonFiniteCheck
from unison.callbacks.preemption import Preemption
from unison.checkpoint.callback import Checkpoint
from unison.data.batch import batch_size_of, map_tensors, take_rows
from unison.distributed.strategy import ParallelConfig
from unison.events import fire
from unison.fastai.accumulation import Accumulation, find_accumulation, refuse_unresumable
from unison.fastai.loader import RankShardedFastaiDL, check_loader_agrees, check_loaders_agree, needs_share
from unison.fastai.lr_find import end_sweep, start_sweep
from unison.fastai.state import (
    CallbackStates,
    DataOrderState,
    PlainStateOptimizer,
    RecorderView,
    as_rng_state,
    rng_list,
    user_callbacks,
)
from unison.loop_state import BatchState
from unison.losses import zero_loss
from unison.rng import get_rng_state, set_rng_state
from unison.run_host import RunHost

__all__ = ["UnisonBridge"]

#: unison's cancel exceptions (raised by engine callbacks) as fastai's loop knows them: fastai's of
#: the same name (CancelFitException, ..., CancelBatchException).
_CANCELS = {
    cls: getattr(fastai_core, name) for name, cls in vars(unison_events).items() if name.startswith("Cancel")
}


class _AfterRecorder(fastai_core.Callback):
    """The bridge's `after_*` events, run after fastai's Recorder (50) and progress (60) logged
    the batch or epoch: the check-exact probe reads what they recorded."""

    order = 95

    def __init__(self, bridge: UnisonBridge) -> None:
        self.bridge = bridge

    def before_epoch(self) -> None:
        if self.bridge.skipping:  # an epoch the checkpoint had finished (as fastai's SkipToEpoch, 70)
            raise fastai_core.CancelEpochException()

    def after_batch(self) -> None:
        if self.learn.training:
            self.bridge.fire("after_batch")

    def after_train(self) -> None:
        if not self.bridge.skipping:
            self.bridge.fire("after_train")

    def after_epoch(self) -> None:
        # (a skipped epoch must not write a checkpoint over the newer one; nor may get_preds)
        if not self.bridge.skipping and not self.learn.lock.locked():
            self.bridge.fire("after_epoch")

    def after_fit(self) -> None:
        try:
            if not self.learn.lock.locked():
                self.bridge.end_fit()
        finally:
            self.bridge.leave_fit()


class UnisonBridge(fastai_core.Callback):
    """Carries a fastai `Learner`'s events to unison's engine (see the module's docstring).
    Added by `unison.fastai.to_distributed` / `distrib_ctx`; not meant to be added by hand."""

    order = -5  # after TrainEvalCallback (-10) sets the phase; before Recorder (50) and progress (60)

    def __init__(
        self, learn: Any, config: ParallelConfig, checkpoint_every: int | None = None, resume: bool = False
    ) -> None:
        # fastai's optimizer is made now, over the model's own BatchNorm layers: fastai finds them by
        # their class (no weight decay on BatchNorm unless `wd_bn_bias`), and exact sync BatchNorm is
        # another class. `fit` keeps an existing optimizer, as it would have kept its own.
        if learn.opt is None:
            learn.create_opt()
        self.opt_at_setup = learn.opt
        host = RunHost(config, 1, Path(learn.path), Path(learn.model_dir))
        host.parallel_api = "learn.distrib_ctx"  # (where the engine's messages send a fastai user's options)
        host.model, host.loss_func = learn.model, learn.loss_func
        self.recorder = host.recorder = RecorderView(learn)
        host.add_cb(NonFiniteCheck("stop"))
        probe = attach_if_checking(host)  # only under `unison check-exact` (float64 before any wrapper)
        self.float64_probe = probe is not None and probe.float64
        engine.attach_strategy(host, config)  # the process group, exact BatchNorm, DDP
        self.host, self.after_recorder = host, _AfterRecorder(self)
        self.shards: dict[tuple[int, bool], tuple[Any, RankShardedFastaiDL]] = {}
        self.loss_terms = torch.zeros(2, dtype=torch.float64)  # this rank's (loss sum, count) of the batch
        self.sweep = False
        self.saved_logger: Any = None
        learn.model = host.model
        # Checkpoints (the engine's `Checkpoint`: atomic, verified, RNG and data order kept) and resume.
        self.checkpointing = checkpoint_every is not None or resume
        self.resume_pending, self.order_state = resume, DataOrderState(self)
        self.order_before_epoch: dict[str, Any] | None = None
        self.pending_order: dict[str, Any] | None = None  # a mid-epoch resume's epoch-start generators
        self.skip_to: tuple[int, int] | None = None  # (epoch, batch) a resumed fit continues at
        self.iter_offset = 0
        self.paused: list[Any] = []  # the user's callbacks paused while a resumed fit passes finished epochs
        self.csv_starts: dict[str, int] = {}  # each CSVLogger's file size when the fit began (rank 0)
        self.before_sweep: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.quiet = contextlib.ExitStack()  # rank > 0: fastai's messages (print) from rank 0 alone
        self.quiet_depth = 0
        self.batch_told = False
        self.accumulation: Accumulation | None = None  # fastai's GradientAccumulation, counted globally
        if self.checkpointing:
            # Preemption: a scheduler's signal (SIGTERM, SIGUSR1) checkpoints every rank at one step and
            # exits 75; the job resubmitted resumes (its handlers are installed by distrib_ctx).
            states = CallbackStates(learn, self.csv_starts)
            checkpoint = Checkpoint(every=checkpoint_every, components={"fastai_callbacks": states})
            preemption = Preemption()
            preemption.resume_as = "distrib_ctx(learn, resume=True)"  # (the bridge's, not fastai's fit)
            host.add_cbs([checkpoint, self.order_state, preemption])

    @property
    def world_size(self) -> int:
        return self.host.collective.world_size

    def fire(self, event: str) -> None:
        """`event` to the engine's callbacks (to the strategy alone during `lr_find`'s sweep), with
        unison's cancel exceptions raised as fastai's."""
        host = self.host
        try:
            if self.sweep:
                fire([host.strategy] if host.strategy is not None else [], event)
            else:
                host(event)
        except tuple(_CANCELS) as exc:
            raise _CANCELS[type(exc)]() from exc

    @property
    def shares_files(self) -> bool:
        """Whether `learn.save`/`load`/`export` go through `together` (W > 1, outside `lr_find`'s
        sweep, whose temporary file is rank 0's own and whose start every rank restores in memory)."""
        return self.world_size > 1 and not self.sweep

    def shard(self, dl: Any, pad: bool) -> Any:
        """This rank's share of `dl` (kept across epochs); `dl` itself where none is needed."""
        if isinstance(dl, RankShardedFastaiDL) or not needs_share(dl, self.world_size, self.checkpointing):
            return dl
        key = (id(dl), pad)
        if key not in self.shards or self.shards[key][0] is not dl:
            collective = self.host.collective
            self.shards[key] = (dl, RankShardedFastaiDL(dl, collective.rank, collective.world_size, pad))
        return self.shards[key][1]

    # ---- the fit ------------------------------------------------------------------------
    def before_fit(self) -> None:
        learn, host = self.learn, self.host
        self.sweep = any(type(cb).__name__ == "LRFinder" for cb in learn.cbs)
        if self.checkpointing and not self.sweep and not learn.lock.locked():
            refuse_unresumable(learn, self.shard(learn.dls.train, pad=False), self.world_size)
        if self.world_size > 1 and not learn.lock.locked():
            self.accumulation = find_accumulation(learn)
        if self.world_size > 1 and self.sweep:  # (lr_find)
            train_shard = self.shard(learn.dls.train, pad=False)
            self.before_sweep = start_sweep(learn, self.host.raw_model, train_shard)
        if learn.opt is not self.opt_at_setup and self.world_size > 1:
            raise ValueError(
                "unison.fastai: the optimizer was made again inside distrib_ctx (fit(reset_opt=True) or "
                "create_opt()): fastai would not see the synchronised BatchNorm layers and would decay "
                "their weights; make it before distrib_ctx, or leave reset_opt=False"
            )
        host.opt = cast(torch.optim.Optimizer, PlainStateOptimizer(learn.opt))  # (fastai's, read as torch's)
        host.loss_func, host.n_epoch = learn.loss_func, learn.n_epoch
        # (what check-exact's probe reads of the training loader: the per-process batch)
        host.dls = SimpleNamespace(train=SimpleNamespace(batch_size=learn.dls.train.bs), valid=None)
        host.lr_finder = True if self.sweep else None  # (the check-exact probe leaves a sweep alone)
        if host.collective.rank != 0:  # (so W > 1)
            self.quiet_depth += 1  # (a get_preds inside a fit is a fit inside a fit)
            if self.quiet_depth == 1:
                devnull = self.quiet.enter_context(open(os.devnull, "w"))
                self.quiet.enter_context(contextlib.redirect_stdout(devnull))
        if learn.lock.locked():
            return  # validate / get_preds: fastai's own before_fit, no fit for the engine's callbacks
        if self.world_size > 1:
            check_loaders_agree(learn.dls, host.collective)
            if host.collective.rank != 0:
                self.saved_logger, learn.logger = learn.logger, noop
                files.silence_loggers(learn)
            elif not self.sweep and not self.batch_told:
                self.batch_told = True
                bs = learn.dls.train.bs
                world = self.world_size
                print(f"unison.fastai: global batch {bs * world} = {world} processes x {bs}")
        if host.collective.rank == 0:
            self.csv_starts.update(files.csv_starts(learn))
        self.fire("before_fit")

    def end_fit(self) -> None:
        self.skip_to, self.iter_offset = None, 0
        self.resume_callbacks()
        if self.saved_logger is not None:
            self.learn.logger, self.saved_logger = self.saved_logger, None
        try:
            self.fire("after_fit")
        finally:
            self.sweep = False
            if self.before_sweep is not None:
                end_sweep(self.learn, self.host.raw_model, self.before_sweep)
                self.before_sweep = None

    def leave_fit(self) -> None:
        """After any fit, validate or get_preds: rank > 0 prints again once the outermost ends."""
        self.quiet_depth = max(0, self.quiet_depth - 1)
        if self.quiet_depth == 0:
            self.quiet.close()

    def before_epoch(self) -> None:
        learn = self.learn
        # (validate and get_preds fire before_epoch too, holding fastai's lock: only a fit resumes)
        if self.resume_pending and not self.sweep and not learn.lock.locked():
            self.resume_pending = False
            self.restore_checkpoint()
        if self.skipping and not self.paused:
            # The finished epochs pass without the user's callbacks (their state is the checkpoint's)
            self.paused = [cb for _, cb in user_callbacks(learn) if cb.run]
            for cb in self.paused:
                cb.run = False
        elif not self.skipping:
            self.resume_callbacks()
        self.host.epoch = learn.epoch
        if not learn.lock.locked():
            self.fire("before_epoch")

    def before_train(self) -> None:
        learn, host = self.learn, self.host
        if self.pending_order is not None:  # the resumed epoch draws its order as it first did
            order, self.pending_order = self.pending_order, None
            after = get_rng_state()
            set_rng_state(order["rng"])
            learn.dls.train.rng.setstate(as_rng_state(order["fastai"]))
            self.order_before_epoch = order
            learn.dl = self.shard(learn.dl, pad=False)
            learn.dl.on_drawn = lambda: set_rng_state(after)  # then the checkpoint's generators again
        else:
            self.order_before_epoch = {"fastai": rng_list(learn.dls.train.rng), "rng": get_rng_state()}
            learn.dl = self.shard(learn.dl, pad=False)
        host.dl, host.training, host.n_iter = learn.dl, True, len(learn.dl)
        host.grad_sync = True
        if self.accumulation is None or self.accumulation.count == 0:  # (accumulation runs across epochs)
            host.exact_loss.start_epoch(learn.dl.bs)
        self.iter_offset = 0
        if self.skip_to is not None and self.skip_to[0] == learn.epoch and self.skip_to[1]:
            # Mid-epoch: the epoch's order drawn again, its first batches skipped unloaded, the
            # schedule where the checkpoint left it.
            self.iter_offset = self.skip_to[1]
            learn.dl.set_start(self.iter_offset)
            learn.train_iter = learn.epoch * len(learn.dl) + self.iter_offset
            learn.pct_train = learn.train_iter / (len(learn.dl) * learn.n_epoch)
        self.fire("before_train")

    @property
    def skipping(self) -> bool:
        return self.skip_to is not None and self.learn.epoch < self.skip_to[0]

    def resume_callbacks(self) -> None:
        for cb in self.paused:
            cb.run = True
        self.paused = []

    def after_cancel_epoch(self) -> None:
        # A finished epoch passed by a resumed fit: fastai's Recorder logs and keeps its row again,
        # so the table, `recorder.values` and the trackers that read them are the uninterrupted run's.
        rows = self.recorder.rows
        if self.skipping and self.learn.epoch < len(rows):
            self.learn.recorder.log = L([self.learn.epoch, *rows[self.learn.epoch]])

    def restore_checkpoint(self) -> None:
        """The newest checkpoint, if any: weights, RNG, fastai's data order, where this fit continues."""
        host, ckpt = self.host, self.host.get_cb(Checkpoint)
        point = ckpt.restore_latest() if ckpt is not None else None
        if point is None:
            return
        engine.start_at(host, point)
        self.skip_to = (point.epoch, point.step)
        if host.collective.rank == 0:  # (the one writer)
            files.rewind_csv_logs(self.learn, self.csv_starts)
        loaded = self.order_state.loaded
        if loaded is not None and point.step:
            self.pending_order = loaded["before_epoch"]
        elif loaded is not None:
            self.learn.dls.train.rng.setstate(as_rng_state(loaded["now"]))

    def before_validate(self) -> None:
        learn, host = self.learn, self.host
        given, learn.dl = learn.dl, self.shard(learn.dl, pad=True)
        if learn.dl is not given and learn.lock.locked() and self.world_size > 1:  # (validate, get_preds)
            check_loader_agrees(given, host.collective)
        host.dl, host.training = learn.dl, False

    # ---- one batch ----------------------------------------------------------------------
    def before_batch(self) -> None:
        learn, host = self.learn, self.host
        if learn.training:
            learn.iter += self.iter_offset  # (a resumed epoch's batches keep their own numbers)
        real, padded = engine.real_rows(host, learn.iter), learn.xb  # (host.dl is learn.dl, sharded)
        if learn.training and real is not None and real < batch_size_of(learn.xb):
            # Training only: padding must not enter BatchNorm's statistics nor the loss. (An evaluation
            # batch runs whole; its padded rows are dropped from the outputs before anything scores them.)
            learn.xb, learn.yb = take_rows(learn.xb, real), take_rows(learn.yb, real)
        host.iter, host.training = learn.iter, learn.training
        host.batch = BatchState(learn.xb, learn.yb, padded, real == 0)
        if learn.training and self.accumulation is not None:
            host.grad_sync = self.accumulation.before_batch(learn.dl.global_rows(learn.iter))
        self.fire("before_batch")
        learn.xb, learn.yb = host.xb, host.yb  # (float64 under `unison check-exact --float64`)

    def after_batch(self) -> None:
        learn = self.learn
        scored = learn.metrics and getattr(getattr(learn, "recorder", None), "train_metrics", False)
        if learn.training and self.world_size > 1 and scored:
            # fastai's train metrics (Recorder, 50) score the global batch, as one process's do
            gather = self.host.collective.gather_ordered
            learn.pred = map_tensors(lambda t: gather(t.detach()), learn.pred)
            learn.yb = tuple(map_tensors(gather, y) for y in learn.yb)

    def after_pred(self) -> None:
        learn = self.learn
        real = engine.real_rows(self.host, learn.iter)
        if learn.training or real is None:
            return
        gather = self.host.collective.gather_ordered
        # Every rank's rows of this batch, in data order, padding dropped: fastai's loss and metrics
        # (and get_preds) then see the global batch, the same on every rank.
        learn.pred = map_tensors(lambda t: gather(take_rows(t, real)), learn.pred)
        learn.yb = tuple(map_tensors(lambda t: gather(take_rows(t, real)), y) for y in learn.yb)
        gathering = getattr(learn, "gather_preds", None)
        if gathering is not None and getattr(gathering, "with_input", False) and gathering.inputs:
            # get_preds(with_input=True) kept this rank's inputs at before_batch: every rank's instead
            inputs = tuple(map_tensors(lambda t: gather(take_rows(t, real)), x) for x in learn.xb)
            gathering.inputs[-1] = learn.to_detach(inputs)

    def after_loss(self) -> None:
        learn, host = self.learn, self.host
        if not learn.training or getattr(learn, "loss_grad", None) is None:
            return
        host.pred, host.xb, host.yb = learn.pred, learn.xb, learn.yb
        host.loss, host.loss_grad = learn.loss.detach(), learn.loss_grad  # this rank's own loss
        if self.world_size > 1:
            self._route_loss()
        self.fire("after_loss")  # NonFiniteCheck: a rank's non-finite loss reaches every rank's gradient
        learn.loss_grad = host.loss_grad

    def _route_loss(self) -> None:
        """The batch's mean loss as a sum and a count, through the engine's `ExactLoss`: the step's
        gradient is then one process's at the global batch; the recorded loss the global batch's."""
        learn, host = self.learn, self.host
        mean = learn.loss_grad
        count = float(batch_size_of(learn.yb) if learn.yb else batch_size_of(learn.xb))
        if host._empty_share:
            count, total, mean = 0.0, zero_loss(learn.pred), None
        else:
            total = mean * count
        host.exact_loss.count_is_rows = True
        engine.score(host, total, count, mean)  # (after_loss hands its loss_grad to fastai)
        # (summed over ranks after the backward pass: a rank stalled before it is then seen behind
        # its peers at DDP's all-reduce, and named)
        self.loss_terms = torch.stack([total.detach().double().reshape(()), torch.tensor(count).double()])

    def before_backward(self) -> None:
        self.fire("before_backward")

    def after_backward(self) -> None:
        learn = self.learn
        if self.world_size > 1:
            if self.host.grad_sync:  # (the last micro-batch of a step)
                self.host.exact_loss.normalise_grads(self.host)
                if self.accumulation is not None:
                    self.accumulation.scale(self.host.model)
            summed = self.host.collective.sum(self.loss_terms)
            learn.loss = (summed[0] / summed[1]).to(learn.loss.dtype)  # the global batch's loss, recorded
        self.fire("after_backward")
        if not self.sweep:
            self.recorder.losses.append(float(learn.loss.detach()))
        if self.float64_probe and learn.loss.dtype == torch.float64:
            # fastai's smoothed loss is float32 whatever the model (its `tensor()` casts float64), and
            # refuses a float64 loss: under `check-exact --float64` it gets the loss as float32.
            learn.loss = learn.loss.float()

    def before_step(self) -> None:
        if self.accumulation is not None:
            self.accumulation.before_step()
        self.fire("before_step")

    def after_step(self) -> None:
        self.fire("after_step")

    # ---- leaving ------------------------------------------------------------------------
    def restore(self) -> None:
        """The learner's model as it was (unwrapped, BatchNorm plain) and the process group left."""
        # fastai's reference to the DDP wrapper goes first, so that its last one goes while the group
        # is alive and the group itself is destroyed after gloo's threads settle (destroy_group).
        # Dropped after that, it freed the group with it, unsettled: DDP's teardown deadlock
        # (pytorch/pytorch#56297), a rank hung in a loaded full run.
        self.quiet.close()
        self.quiet_depth = 0
        self.learn.model = self.host.raw_model
        engine.detach_strategy(self.host)
        self.learn.model = self.host.model
        self.shards.clear()

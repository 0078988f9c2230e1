"""`Run`: your own training loop, with the `Learner`'s guarantees, by the `Learner`'s engine.

    run = unison.Run()                      # or shard=True (FSDP2), fault_tolerant=True (torchft replicas)
    model, opt = run.setup(model, opt)      # DDP / FSDP2 / torchft, exact BatchNorm, this process's device
    train = run.loader(train_dl)            # one global order for any W, no duplicates, resumable
    run.checkpoint(every=100)               # atomic; run.epochs(n, resume=True) continues mid-epoch
    for epoch in run.epochs(10):
        model.train()
        for x, y in train:
            loss = run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y))
            run.backward(loss)
            opt.step(); opt.zero_grad()
        model.eval()
        with torch.no_grad():
            preds = [run.gather(model(x).argmax(1)) for x, _ in valid]   # every item once, in order

A `Run` is a host of the engine (`unison.engine`), as the `Learner` is: the strategy `ParallelConfig`
chooses (DDP, FSDP2), the rank-sharded loaders, the exact loss (a sum and a count, the gradient
divided by the global count at each step), and the callbacks that hold the guarantees
(`NonFiniteCheck`, `Preemption`, `Checkpoint`, `Recorder`, `unison check-exact`'s probe) are the
Learner's own, driven here at the same events from the points of your loop: iterating a loader
(before_batch, after_batch), `run.loss` (after_loss), `run.backward` (before/after_backward) and the
optimizer `setup` returns (before/after_step; a no-op on accumulation micro-steps).

With `fault_tolerant=True` each replica (a process, or a `unison launch --nproc G` group) trains its
share of every global batch on torchft (`unison.distributed.fault_tolerant`, the Learner's trainer):
a replica lost mid-step fails the step's commit vote, and the survivors' loop body runs again over
the same items, re-split among those left (`run.redoing` is True in the failed pass, whose
`opt.step()` is skipped); a replacement heals from a live peer and joins.

What it cannot make exact (a loss averaged on each rank, a backward outside `run.backward`, ...) it
refuses in one line rather than train silently wrong: docs/own-loop.md lists each refusal.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

import unison.engine as engine
from unison.callbacks.defaults import default_callbacks
from unison.callbacks.exactness_probe import attach_if_checking
from unison.callbacks.nonfinite import Mode
from unison.callbacks.preemption import OnPreempt, Preemption, handling
from unison.callbacks.progress import ProgressCallback
from unison.checkpoint import learner_files
from unison.checkpoint.callback import Checkpoint
from unison.checkpoint.components import stateful_problem
from unison.data.batch import map_tensors
from unison.data.loader import shard_problem
from unison.distributed.env import num_distrib, rank_distrib
from unison.distributed.strategy import ParallelConfig
from unison.events import Callback, CancelEpochException, CancelFitException
from unison.run_checks import (
    averaged_wrapper_problem,
    check_schedulers,
    loss_terms,
    refuse_learner_callback,
    require_backward_of,
    require_training_batch,
)
from unison.run_host import LoaderOrders, RunHost, RunLoader, RunOptimizer, RunScheduler, track_steps

__all__ = ["Run"]


class Run:
    """Your own loop on 1 or W processes, W processes equal to one at the same global batch.

    Options are `distrib_ctx`'s (`shard`, `fault_tolerant`: True or `FaultTolerantTrainer`'s options,
    `sync_bn`, `timeout`, `cuda_id`, `backend`, `check_data`, DDP's or FSDP2's keyword arguments)
    and: `accumulate` (optimizer steps every k batches, the gradient that of the k batches together:
    a global batch of B on W processes is a loader batch of B / (W x k), B divisible by W x k),
    `path`/`model_dir` (where checkpoints go), `on_nonfinite` ("stop" or "skip"), `on_preempt`
    ("stop", "requeue" or None).
    `run.recorder` holds each epoch's exact training (and validation) loss.

        with unison.Run() as run:
            model, opt = run.setup(model, torch.optim.AdamW(model.parameters()))
    """

    def __init__(
        self,
        *,
        shard: bool = False,
        fault_tolerant: bool | dict[str, Any] = False,
        sync_bn: bool = True,
        timeout: float | None = None,
        cuda_id: int | None = None,
        backend: str | None = None,
        accumulate: int = 1,
        path: str | Path = ".",
        model_dir: str | Path = "models",
        on_nonfinite: Mode | None = "stop",
        on_preempt: OnPreempt | None = "stop",
        **options: Any,
    ) -> None:
        if on_nonfinite == "anomaly":
            raise ValueError('Run(on_nonfinite="anomaly") is not supported (it reruns the loss): use "stop"')
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"Run: accumulate must be a positive int, got {accumulate!r}")
        if fault_tolerant and accumulate > 1:
            raise ValueError(
                f"Run(fault_tolerant=True) does not support accumulate={accumulate} yet (a lost replica's "
                "step would be redone over its last batch only): give the loader the whole global batch"
            )
        options["fault_tolerant"] = fault_tolerant
        config = ParallelConfig.from_arguments(cuda_id, sync_bn, timeout, backend, shard, **options)
        self.host = RunHost(config, accumulate, Path(path), Path(model_dir))
        defaults = default_callbacks(self.host.recorder, on_nonfinite, on_preempt)
        self.host.add_cbs(cb for cb in defaults if not isinstance(cb, ProgressCallback))  # (no bars here)
        for cb in defaults:
            if isinstance(cb, Preemption):  # its message names this loop's resume
                cb.resume_as = "run.epochs(n, resume=True)"
        self._open = False
        self._orders = LoaderOrders(self.host)  # what checkpoints and heals carry besides model and opt:
        self._components: dict[str, Any] = {"data_order": self._orders}
        self._setup_lrs: list[Any] | None = None  # each group's LR as `setup` left it
        self._opt = RunOptimizer(self.host, self._components)  # what `setup` returns, over the given one
        self._backwarding = False  # inside run.backward: the loss's own .backward() is refused outside it

    # ---- the loop's parts ----------------------------------------------------------------
    def setup(self, model: nn.Module, opt: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Any:
        """Join the launch's process group (a no-op outside one) and train `model` with the strategy:
        its BatchNorm synchronised exactly, wrapped for DDP (or sharded with `shard=True`), on this
        process's device. Returns the model to call, the optimizer to step and, when given, the LR
        scheduler to step: its `step()` takes effect at real optimizer steps only (not on
        accumulation micro-steps, not in a redone torchft pass), and its state is checkpointed and
        carried by a torchft heal. `run.setup(model)` alone: evaluation only (returns the model).

            model, opt, sched = run.setup(model, opt, OneCycleLR(opt, 1e-3, total_steps=n))
        """
        host = self.host
        if host.model is not None:
            raise RuntimeError("Run.setup was called already: one model and optimizer per Run")
        if opt is not None and not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"Run.setup(model, opt): opt must be a torch optimizer, got {type(opt).__name__}")
        problem = stateful_problem(scheduler) if scheduler is not None else None
        if problem is not None or (scheduler is not None and opt is None):
            raise TypeError(
                f"Run.setup(model, opt, scheduler): {problem or 'a scheduler needs its optimizer'}"
            )
        host.model = model
        if opt is not None:
            host.opt, host.lr = opt, opt.defaults.get("lr")
            # (FSDP2 rebuilds the optimizer over the shards: the same kind, the same hyper-parameters,
            # of those its constructor takes; every group's own values are copied over after.)
            accepted = inspect.signature(type(opt)).parameters
            options = {k: v for k, v in opt.defaults.items() if k in accepted}
            host.opt_func = lambda params, lr=None: type(opt)(params, **options)
        attach_if_checking(host)  # only under `unison check-exact`: records the first steps
        engine.attach_strategy(host, host.config)
        carry = getattr(host.strategy, "carry", None)
        if carry is not None:  # torchft: a replacement heals these from a peer too
            carry(self._components)
        self._open = True
        if host.opt is None:
            return host.model
        self._setup_lrs = [group["lr"] for group in host.opt.param_groups]
        if scheduler is None:
            return host.model, self._opt
        if host.opt is not opt and getattr(scheduler, "optimizer", None) is opt:
            scheduler.optimizer = host.opt  # (FSDP2's rebuilt optimizer, with the same groups' values)
            track_steps(host.opt)
        self._components["scheduler"] = host.scheduler = scheduler
        return host.model, self._opt, RunScheduler(host, scheduler)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore `objects` (each with `state_dict` / `load_state_dict`: an EMA of the
        weights, updated when `run.sync_gradients` is True, a step counter, ...) with every checkpoint,
        and carry them in a torchft heal; restored after the optimizer, whose hyper-parameters they
        leave as restored. Register the same objects, in the same order, in the run that resumes.

            run.register_for_checkpointing(ema)
        """
        for obj in objects:
            problem = stateful_problem(obj) or averaged_wrapper_problem(obj)
            if problem is not None:
                raise TypeError(f"Run.register_for_checkpointing: {problem}")
            kind = type(obj).__name__
            index = sum(name.startswith(f"{kind}:") for name in self._components)
            self._components[f"{kind}:{index}"] = obj

    def loader(self, dl: DataLoader, *, train: bool | None = None) -> RunLoader:
        """This rank's share of `dl`, each epoch in the order `dl` itself draws (from its `generator`,
        or its sampler's, else the global one as `RandomSampler` does: one process trains on the batches
        of the plain loop; W processes deal that global order), every item once, padding removed;
        resumable mid-epoch. Iterate it with the model
        in train mode for a training pass, in eval mode for an evaluation. The first loader given is
        the training one (whose steps checkpoints count) unless `train` says otherwise.

            train = run.loader(DataLoader(ds, batch_size=32, shuffle=True))
        """
        host = self.host
        self._require_setup("loader")
        is_train = train if train is not None else host.dls.train is None
        several = host.collective.world_size > 1
        problem = shard_problem(dl) if several else None
        if problem is not None:
            raise ValueError(f"Run.loader: this loader cannot be sharded across processes: {problem}")
        if isinstance(dl, DataLoader) and not isinstance(dl.dataset, IterableDataset):
            # each epoch in the order the loader itself draws: one process = the plain loop
            self._orders.add(dl)
        if several:
            engine.check_loader_agrees(host, dl, "train" if is_train else "valid", host.config.check_data)
        if is_train:
            host.dls.train = dl
        elif host.dls.valid is None:
            host.dls.valid = dl
        return RunLoader(host, dl)

    def epochs(self, n: int, *, resume: bool = False) -> Iterator[int]:
        """The epochs `0 .. n-1`; with `resume=True` from the newest checkpoint's position (mid-epoch:
        the training loader continues at the step after it). Checkpoints, preemption and the
        non-finite check act between the batches and epochs of this loop.

            for epoch in run.epochs(10, resume=True): ...
        """
        host = self.host
        self._require_setup("epochs")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"Run.epochs: n must be a non-negative int, got {n!r}")
        if resume and host.get_cb(Checkpoint) is None:
            self.checkpoint()
        engine.start_fit(host, n, learner_files.resume(host) if resume else None)
        if host.opt is not None:
            host.opt.zero_grad(set_to_none=True)
        with handling(host):  # preemption signals, handled while the epochs run
            try:
                host("before_fit")
                for epoch in range(host.start_epoch, n):
                    host.epoch = epoch
                    try:
                        host("before_epoch")
                        yield epoch
                    except CancelEpochException:
                        host("after_cancel_epoch")
                    host("after_epoch")
            except CancelFitException:
                host("after_cancel_fit")
            host("after_fit")

    def loss(self, value: Tensor, count: float | Tensor | None = None, *, reduction: str = "sum") -> Tensor:
        """What to backpropagate for this batch's loss: `value` is the sum of `count` loss terms
        (samples, tokens), and W processes then train exactly as one on the global batch, whatever
        each rank's count. Per-item losses (`reduction="none"`) need no count, unless their loss left
        targets out (`ignore_index`: refused, naming the count); `reduction="mean"` with `count`
        takes a mean. In evaluation it returns the batch's mean loss.

            loss = run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y))
        """
        host = self.host
        total, count, mean = loss_terms(value, count, reduction)
        if host.model is not None and host.model.training:
            require_training_batch(host, "Run.loss")
        host.exact_loss.count_is_rows = False  # counted by the loop: summed over ranks at each step
        engine.score(host, total, count, mean)
        host("after_loss")
        out = host.loss_grad
        assert out is not None
        if host.training and out.requires_grad:
            out.register_hook(self._refuse_bare_backward)  # `.backward()` on it, not run.backward(it)
        return out

    def backward(self, loss: Tensor) -> None:
        """Backpropagate what `run.loss` returned; at the last batch of an optimizer step the
        gradient becomes that of the global batch (every rank and accumulated batch)."""
        host = self.host
        require_backward_of(host, loss)
        host("before_backward")
        self._backwarding = True
        try:
            self._opt.refuse_a_changed_untaken_step()  # (clipping at an accumulation micro-step)
            engine.backward(host)
        finally:
            self._backwarding = False
        engine.commit_step(host)  # under torchft: a failed step is redone by the loop's body
        host("after_backward")
        self._opt.hold_untaken_step()

    def _refuse_bare_backward(self, grad: Tensor) -> None:
        if not self._backwarding:
            raise RuntimeError(
                "Run: a loss from run.loss was backpropagated with .backward(): call run.backward(loss) "
                "instead (it makes the step's gradient that of the global batch)"
            )

    def checkpoint(
        self, every: int | None = None, fname: str = "checkpoint", keep_previous: bool = False
    ) -> Path:
        """Save a resumable checkpoint every `every` training batches (at the optimizer step ending
        them: with `accumulate=k`, `every` a multiple of k) and at each epoch's end (atomic, one
        writer; every rank its own shards with `shard=True`). Call it before the loop or in it;
        `run.epochs(n, resume=True)` continues from it. Returns the checkpoint's file.

            run.checkpoint(every=100)
        """
        ckpt = self.host.get_cb(Checkpoint)
        accumulate = self.host.accumulate
        if every is not None and isinstance(every, int) and every % accumulate:
            raise ValueError(
                f"Run.checkpoint(every={every}): with accumulate={accumulate} a checkpoint is taken at an "
                f"optimizer step, every {accumulate} batches: give every a multiple of {accumulate}"
            )
        if ckpt is None:
            ckpt = Checkpoint(
                every=every,
                fname=fname,
                keep_previous=keep_previous,
                components=self._components,
                checks=[lambda: check_schedulers(self.host, self._setup_lrs, self._components, self._opt)],
            )
            self.host.add_cb(ckpt)
        elif every is not None and ckpt.every != every:
            ckpt.every = Checkpoint(every=every).every  # (checked as the constructor checks it)
        return ckpt.file

    def gather(self, value: Any, pad_value: float | None = None) -> Any:
        """`value` (a tensor, or a tuple / list / dict of them, one row per item of this rank's batch)
        from every rank, rows in data order, on every rank: each valid item once, padding never.
        Rows whose sizes differ between ranks (generated sequences) are refused unless `pad_value`
        says what fills the shorter ones, as one process pads its batch.

            preds = run.gather(model(x).argmax(1))
        """

        def gathered(t: Tensor) -> Tensor:
            if t.dim() == 0:  # (on one process too: the script must not fail only on W)
                raise ValueError(
                    "run.gather: a 0-dim tensor has no rows to put in data order (one value per rank "
                    'weighs ranks, not items): gather per-item values (a loss with reduction="none"); '
                    "the exact epoch losses are in run.recorder.values"
                )
            return self.host.collective.gather_ordered(t, pad_value, "run.gather")

        return map_tensors(gathered, value)

    def add_cb(self, cb: Callback) -> Run:
        """Attach a unison callback, run at the events this loop reaches (`GradientClip`, ...); one
        that drives the Learner's own loop is refused, naming what the own loop uses instead."""
        refuse_learner_callback(cb)
        self.host.add_cb(cb)
        return self

    # ---- where this process stands --------------------------------------------------------
    # (Before `setup` and after `close` the launch says: a script that reads `run.is_main` first, as
    # nanoGPT's `master_process`, must not write its files from every rank.)
    @property
    def rank(self) -> int:
        """This process's rank, 0 .. W-1 (before `setup` too: read from the launch)."""
        return self.host.collective.rank if self._open else rank_distrib()

    @property
    def world_size(self) -> int:
        """The number of processes, W (before `setup` too: read from the launch)."""
        return self.host.collective.world_size if self._open else num_distrib()

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes (before `setup` too)."""
        return self.host.collective.is_main if self._open else rank_distrib() == 0

    @property
    def epoch(self) -> int:
        """The epoch in progress."""
        return self.host.epoch

    @property
    def batch(self) -> int:
        """The index of the training batch in progress within its epoch (after a resume too)."""
        return self.host.iter

    @property
    def sync_gradients(self) -> bool:
        """True in a training batch whose `opt.step()` is a real optimizer step: the last batch of an
        accumulated step (Accelerate's `sync_gradients`), not a torchft pass whose commit failed.
        A per-step counter or a scheduler stepped your own way steps when this is True.

            opt.step(); step += run.sync_gradients
        """
        host = self.host
        return bool(host.grad_sync and not host.redo_step)

    @property
    def redoing(self) -> bool:
        """True from a `run.backward` whose torchft commit vote failed (`fault_tolerant=True`: a
        replica was lost mid-step) until the loader yields the step again: this pass's `opt.step()`
        is skipped, as the `step()` of a scheduler given to `run.setup` is; skip your own per-step
        bookkeeping too (or count steps by `run.sync_gradients`).

            opt.step(); step += 0 if run.redoing else 1
        """
        return self.host.redo_step

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (batches are moved there)."""
        return self.host.device

    @property
    def recorder(self) -> Any:
        """Each epoch's `[train_loss, valid_loss]` over the global batch (`recorder.values`), and
        each training batch's loss over the global batch (`recorder.losses`, micro-batches included)."""
        return self.host.recorder

    @property
    def model(self) -> nn.Module:
        """The user's model, without the strategy's wrapper (for saving, exporting)."""
        return self.host.raw_model

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs)

    # ---- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unwrap the model and leave the process group this run made (idempotent)."""
        if self._open:
            self._open = False
            engine.detach_strategy(self.host)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if isinstance(exc, Exception):
                engine.name_stalled_rank(self.host, exc)
        finally:
            self.close()

    def _require_setup(self, what: str) -> None:
        if self.host.model is None:
            raise RuntimeError(f"Run.{what}: call run.setup(model, opt) first")

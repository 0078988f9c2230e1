"""The callbacks behind `to_distributed` and `to_parallel`, and torch's wrappers with `reset()`.

`DistributedTrainer` is the whole DDP story in one place: join (or make) the
process group, convert BatchNorm to synchronised BatchNorm, wrap the model in
DistributedDataParallel, point the learner's `Collective` at the group (which
shards every loader and reduces every metric), skip gradient all-reduce on
accumulation micro-steps; then undo all of it on `restore()`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from unison.distributed.devices import place_training_state
from unison.distributed.env import group_active
from unison.distributed.group import setup_distrib
from unison.distributed.joining import (
    MonitoredRanks,
    RankMonitor,
    make_collective,
    shared_seed,
    trainable_set,
    training_device,
)
from unison.distributed.sync_bn import buffers_synchronised, convert_sync_batchnorm, revert_sync_batchnorm
from unison.events import Callback
from unison.loop_state import TrainingParts

#: DDP gradient bucket size on gloo (torch's default is 25). Measured with `benchmarks/run.py --knobs`
#: (2 CPU processes): +8% samples/s on the MLP workload, neutral on the CNN. Fewer, larger all-reduces
#: pay gloo's per-call latency less often; on a CPU, compute and communication share the same cores,
#: so the overlap that smaller buckets buy is worth little. NCCL keeps torch's defaults.
GLOO_BUCKET_CAP_MB = 100


class AutocastReplica(nn.Module):
    """Runs `module` under autocast of `dtype`: autocast's dtype is per thread, and torch's
    `parallel_apply` re-enters autocast in each replica's thread without one (so fp16, unscaled)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class ResetsModule:
    """`reset()` for torch's wrappers: stateful models (RNNs) reset between sequences through it."""

    module: Any  # (the wrapped model: its own `reset` is looked up)

    def reset(self) -> None:
        """Call the wrapped model's `reset()`, where it has one."""
        if hasattr(self.module, "reset"):
            self.module.reset()


class DataParallel(ResetsModule, nn.DataParallel):
    """torch's `DataParallel`, plus `reset()` for stateful models (RNNs), and replicas that keep
    the caller's autocast dtype (`MixedPrecision("bf16")`)."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [AutocastReplica(replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class DistributedDataParallel(ResetsModule, nn.parallel.DistributedDataParallel):
    """torch's `DistributedDataParallel`, plus `reset()` for stateful models (RNNs)."""


class DistributedTrainer(MonitoredRanks, Callback):
    """Train data-parallel over the launch's processes; `Learner.to_distributed` attaches it.

    `setup()` runs when attached, so `fit`, `validate`, `get_preds` and `lr_find` all run
    distributed inside `distrib_ctx`; `restore()` puts everything back as it was.

        unison.engine.attach_strategy(learn, ParallelConfig())   # what learn.to_distributed() does
    """

    # Last: it reads grad_sync after GradientAccumulation set it, and marks "entering the
    # collective" only after every other callback's `before_backward` ran (a stall in one of
    # those must show as this rank lagging).
    order = 1000
    kind = "ddp"
    checkpoint_format = "file"  # whole replicas: rank 0 writes one file

    def __init__(
        self,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        check_data: bool = True,
        backend: str | None = None,
        **ddp_kwargs: Any,
    ):
        self.cuda_id, self.sync_bn, self.timeout, self.ddp_kwargs = cuda_id, sync_bn, timeout, ddp_kwargs
        self.backend = backend  # "gloo": train on the CPU even where CUDA is available
        self.check_data = check_data  # False: ranks may hold different data on purpose (same lengths)
        self.active = False
        self._converted = False
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None
        self._kwargs: dict[str, Any] = {}  # DDP's arguments, as `setup` made them
        #: Which parameters required a gradient when DDP wrapped the model (None: not wrapped).
        self.trainable: tuple[bool, ...] | None = None
        self._first_step = False  # the wrapped model's first step is yet to be checked for unused parameters

    def setup(self, parts: TrainingParts) -> TrainingParts:
        learn = self.learn
        self.created_group = setup_distrib(self.cuda_id, timeout=self.timeout, backend=self.backend)
        self._before = parts
        self._converted = False
        moved_from = learn.device
        try:
            device = self._device()
            if device.type == "cuda":
                torch.cuda.set_device(device)  # (a user's NCCL group made without set_device: not cuda:0)
            # Moved even on one process (`--gpus 1`): the model, its optimizer state and the loss's buffers.
            place_training_state(parts.model, parts.opt, learn.loss_func, device)
            if group_active() and dist.get_world_size() > 1:
                parts = self._wrap(parts, device)
                self.active = True
            return parts
        except BaseException:
            self.restore()  # a refused setup leaves the model as it was, and no group behind
            self.leave()
            if learn.device != moved_from:  # (the host still holds parts.model)
                place_training_state(parts.model, parts.opt, learn.loss_func, moved_from)
            raise

    def _wrap(self, parts: TrainingParts, device: torch.device) -> TrainingParts:
        collective = make_collective(self.learn, device, self.check_data)
        model = parts.model
        kwargs = dict(self.ddp_kwargs)
        if self.sync_bn:
            model = convert_sync_batchnorm(model)
            self._converted = True
            # Equal on every rank by construction: no per-step broadcast (DDP still syncs them at init).
            user_set = {"broadcast_buffers", "forward_sync_buffers"} & set(kwargs)
            if buffers_synchronised(model) and not user_set:
                kwargs["forward_sync_buffers"] = False
        if dist.get_backend() == "gloo":
            kwargs.setdefault("bucket_cap_mb", GLOO_BUCKET_CAP_MB)
        self._kwargs = kwargs
        model = self._ddp(model, device)
        self.monitor = RankMonitor(self.timeout)
        seed = shared_seed(collective, parts.data_seed)
        return replace(parts, model=model, collective=collective, data_seed=seed)

    def _ddp(self, model: nn.Module, device: torch.device) -> nn.Module:
        """`model` in DDP over the parameters that require a gradient now (none: `model` itself: a model
        with nothing to train needs no DDP, only sharded data)."""
        self.trainable = trainable_set(model)
        if not any(self.trainable):
            return model
        device_ids = [device.index] if device.type == "cuda" else None
        # A zero-size parameter never gets a gradient (fastai's collab model keeps a zero-width
        # BatchNorm it never calls): DDP would wait for it; there is nothing of it to synchronise.
        empty = [name for name, p in model.named_parameters() if p.numel() == 0]
        if empty:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, empty)
        handles_unused = {"find_unused_parameters", "static_graph"}  # (DDP's ways around unused parameters)
        self._first_step = not any(self._kwargs.get(name) for name in handles_unused)
        return DistributedDataParallel(model, device_ids=device_ids, **self._kwargs)

    def rewrap(self, parts: TrainingParts) -> TrainingParts:
        """`parts` with the model in a new DDP over the parameters that require a gradient now: DDP
        synchronises the gradients of those it was built with, so a model frozen or unfrozen since
        (fastai's `fine_tune`) needs a new one. The old wrapper's gradient hooks are removed. Every
        rank calls it at the same point (DDP's construction is collective)."""
        if not self.active:
            return parts
        old = parts.model
        inner = old.module if isinstance(old, nn.parallel.DistributedDataParallel) else old
        if isinstance(old, nn.parallel.DistributedDataParallel):
            old.reducer._remove_autograd_hooks()  # (its hooks would all-reduce a second time)
        return replace(parts, model=self._ddp(inner, self._device()))

    def _device(self) -> torch.device:
        return training_device(self.learn, self.cuda_id, self.backend)

    def before_batch(self) -> None:
        if not self.active:
            return
        self._at(0)
        if not self.learn.grad_sync and self.learn.training and hasattr(self.learn.model, "no_sync"):
            # nn.Module's stubs type an unknown attribute as Tensor | Module: no_sync is DDP's method.
            self._no_sync = cast(Any, self.learn.model).no_sync()
            self._no_sync.__enter__()

    def after_backward(self) -> None:
        """At the wrapped model's first real step: refuse (one line, on every rank) parameters that
        got no gradient. DDP waits for every parameter's gradient before it all-reduces any: without
        `find_unused_parameters=True` the step would take each rank's own gradient (silently, at a
        fit's last step), and the next forward pass fails with DDP's advice."""
        learn = self.learn
        if not (self._first_step and learn.training and learn.grad_sync):
            return
        self._first_step = False
        model = cast(nn.Module, learn.model.module)  # (DDP's, as `_ddp` wrapped it)
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.numel() and p.grad is None]
        found = next((names for names in learn.collective.gather_objects(unused) if names), None)
        if found:
            api = learn.parallel_api
            raise RuntimeError(
                f"{api}: parameters {', '.join(found[:4])}{', ...' if len(found) > 4 else ''} got no "
                "gradient (the forward pass does not use them), and DDP waits for every gradient before "
                f"it sums any: pass {api}(find_unused_parameters=True), or freeze them (requires_grad=False)"
            )

    def after_batch(self) -> None:
        # (Not after an evaluation batch inside a training batch, as an own loop may run: the training
        # batch's micro-step is still in flight.)
        if self.learn.training:
            self._leave_no_sync()

    after_cancel_batch = after_batch

    def _leave_no_sync(self) -> None:
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None

    def restore(self) -> TrainingParts:
        """Undo `setup`: the model unwrapped (BatchNorm reverted in place: the user's model object is
        kept), the collective as it was, the group closed where setup made it."""
        self._leave_no_sync()
        self.trainable = None
        self._stop_monitor()
        before = self._before
        if self._converted:
            revert_sync_batchnorm(before.model)
            self._converted = False
        self.active = False
        return replace(before, opt=self.learn.opt, data_seed=self.learn.data_seed)


class ParallelTrainer(Callback):
    """Single-process `DataParallel` over `device_ids`; `Learner.to_parallel` attaches it.

    For example:

        with learn.parallel_ctx([0, 1]):
            learn.fit(1)
    """

    order = -10

    def __init__(self, device_ids: Sequence[int] | None = None):
        self.device_ids = list(device_ids) if device_ids is not None else None

    def setup(self, parts: TrainingParts) -> TrainingParts:
        """`parts` with the model in `DataParallel` over the devices (as they were without CUDA)."""
        self._before = parts
        if not torch.cuda.is_available():
            warnings.warn("to_parallel: no CUDA device, training on one CPU process as before", stacklevel=3)
            return parts
        ids = self.device_ids if self.device_ids is not None else list(range(torch.cuda.device_count()))
        place_training_state(parts.model, parts.opt, self.learn.loss_func, torch.device("cuda", ids[0]))
        return replace(parts, model=DataParallel(parts.model, device_ids=ids))

    def restore(self) -> TrainingParts:
        """The parts as they were before `setup`."""
        return replace(self._before, opt=self.learn.opt, data_seed=self.learn.data_seed)

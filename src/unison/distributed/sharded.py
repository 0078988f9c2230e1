"""`ShardedTrainer`: sharded data parallel with torch's FSDP2 (`fully_shard`): `distrib_ctx(shard=True)`.

Each rank keeps about 1/W of the weights, gradients and optimizer state. The model is
sharded block by block, then at the root, so only one block's full weights exist at a
time. The data side is DDP's: the same `Collective` shards every loader and reduces
metrics, so W sharded processes equal one process at the same global batch.

The user's model object is kept: its parameters are shared with a sharded twin (a
structural copy) and emptied (0 elements) while the twin trains; `restore()` gathers
the trained weights back into them, so after the `with` block the model is an ordinary
single-process module again. The optimizer state is not gathered (see `restore`).
"""

from __future__ import annotations

import copy
import ctypes
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm

from unison.distributed.devices import place_training_state
from unison.distributed.env import group_active
from unison.distributed.fsdp import is_sharded
from unison.distributed.group import setup_distrib
from unison.distributed.joining import (
    MonitoredRanks,
    RankMonitor,
    make_collective,
    shared_seed,
    trainable_set,
    training_device,
)
from unison.distributed.sync_bn import convert_sync_batchnorm
from unison.distributed.watchdog import RankStalledError
from unison.events import Callback
from unison.loop_state import TrainingParts
from unison.optim import top_lr

if TYPE_CHECKING:
    from unison.learner_view import LearnerView

BlockPolicy = Iterable[type[nn.Module]] | Callable[[nn.Module], bool] | None

# float16 is left out: without loss scaling its gradients underflow (a MixedPrecisionPolicy
# with float16 can still be passed, with the caller's own scaling).
_DTYPES = {"bf16": torch.bfloat16}
_FULL = StateDictOptions(full_state_dict=True)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> bool:
    """Have glibc hand large freed buffers back to the system (as `MALLOC_MMAP_THRESHOLD_=65536`).

    By default glibc raises its mmap threshold to the size of any large block freed, up to
    32 MB; then buffers that size are carved from its heap and stay in the process's memory
    once freed. FSDP frees and re-gathers every block's weights at every step, so on a CPU
    the process's memory grew past DDP's (measured in benchmarks/RESULTS.md). Applies to the
    whole process; skipped when the variable is set (the user decided) or without glibc.

    >>> return_freed_memory()
    True
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 65536))
    except (OSError, AttributeError):
        return False


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default block policy: the outermost submodules whose class occurs more than once
    among the modules that hold parameters (transformer layers, the Linear layers of an MLP).

    >>> mlp = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> [type(b).__name__ for b in repeated_blocks(mlp)]
    ['Linear', 'Linear']
    """
    holders = {id(m): m for m in model.modules() if m is not model and any(True for _ in m.parameters())}
    counts = Counter(type(m) for m in holders.values())
    return _outermost(model, lambda m: counts[type(m)] > 1 and id(m) in holders)


def select_blocks(model: nn.Module, blocks: BlockPolicy = None) -> list[nn.Module]:
    """The submodules `fully_shard` wraps one by one before the root, outermost first.

    `blocks` is None (the repeated classes, see `repeated_blocks`), classes, or a
    function `module -> bool`; a selected module's own submodules are not searched. A
    module whose parameters are tied to parameters outside it (an embedding shared with the
    output layer) is never a block: FSDP needs each parameter in one group; its submodules
    are searched instead.

        select_blocks(model, [nn.TransformerEncoderLayer])
    """
    if blocks is None:
        return repeated_blocks(model)
    if callable(blocks) and not isinstance(blocks, type):
        return _outermost(model, blocks)
    try:
        classes = tuple(blocks) if not isinstance(blocks, type) else (blocks,)
    except TypeError:
        classes = ()
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"shard: blocks must be nn.Module classes or a function module -> bool, got {blocks!r}"
        )
    return _outermost(model, lambda m: isinstance(m, classes))


def _registrations(module: nn.Module) -> Counter[int]:
    """How many times each parameter is registered in `module` (more than once when tied)."""
    return Counter(id(p) for m in module.modules(remove_duplicate=False) for p in m.parameters(recurse=False))


def _outermost(model: nn.Module, chosen: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []
    everywhere = _registrations(model)

    def tied_outside(module: nn.Module) -> bool:
        return any(everywhere[i] > n for i, n in _registrations(module).items())

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if chosen(child) and not tied_outside(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _rebuilt_optimizer(
    learn: LearnerView,
    original: nn.Module,
    model: nn.Module,
    old: torch.optim.Optimizer,
    state: dict[str, Any] | None,
) -> torch.optim.Optimizer:
    """A new optimizer of the learner's kind over `model`'s (the sharded twin's) parameters, in
    `old`'s param groups (a splitter's, or the user's: each group's own LR and weight decay), with
    `old`'s hyper-parameters (a schedule may have changed them) and state. `original` is the model
    `old` was built over: its parameter names find each one's shard."""
    names = {id(p): name for name, p in original.named_parameters()}
    shards = dict(model.named_parameters())
    strays = [p for group in old.param_groups for p in group["params"] if id(p) not in names]
    if strays:
        raise ValueError(
            f"the optimizer holds {len(strays)} parameter(s) that are not the model's: FSDP2 shards the "
            "model's own; build the optimizer over model.parameters()"
        )
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [shards[names[id(p)]] for p in group["params"]],
        }
        for group in old.param_groups
    ]
    new = learn.opt_func(groups, lr=top_lr(learn.lr))  # (each group has its own LR)
    if state is not None:
        set_optimizer_state_dict(model, new, state, options=_FULL)
    return new


class ShardedTrainer(MonitoredRanks, Callback):
    """Train fully sharded (FSDP2) over the launch's processes; `to_distributed(shard=True)` attaches it.

    - `blocks`: which submodules are sharded as units (default: the repeated ones).
    - `mixed_precision`: "bf16" (compute in bfloat16, reduce gradients in float32, keep
      float32 master weights), or a torch `MixedPrecisionPolicy`.
    - `cpu_offload`: keep the shards and optimizer state in CPU memory (torch's `CPUOffloadPolicy`).
    - `find_unused_parameters`: ranks may leave different parameters without a gradient
      (reduce-scatters zeros for them, as DDP's option of that name).
    - `reshard_after_forward`: free each block's full weights after its forward (less memory,
      one more all-gather in backward).
    - `release_memory`: on a CPU, have glibc return freed buffers (`return_freed_memory`): a lower
      peak of memory for more CPU time a step (measured in benchmarks/RESULTS.md); off by default,
      as in a hand-written FSDP2 loop.

        with learn.distrib_ctx(shard=True):
            learn.fit(3)
    """

    order = 1000  # last, as DistributedTrainer: it reads grad_sync after GradientAccumulation set it
    kind = "fsdp"

    def __init__(
        self,
        cuda_id: int | None = None,
        sync_bn: bool = True,
        timeout: float | None = None,
        blocks: BlockPolicy = None,
        mixed_precision: str | MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        find_unused_parameters: bool = False,
        reshard_after_forward: bool = True,
        release_memory: bool = False,
        check_data: bool = True,
        backend: str | None = None,
    ):
        select_blocks(nn.Module(), blocks)  # a wrong policy fails here, before anything changes
        if mixed_precision == "fp16":
            raise ValueError(
                "shard: mixed_precision='fp16' is refused (without loss scaling its gradients underflow): "
                "use 'bf16', or pass a torch MixedPrecisionPolicy"
            )
        if isinstance(mixed_precision, str) and mixed_precision not in _DTYPES:
            raise ValueError(
                f"shard: mixed_precision must be one of {sorted(_DTYPES)}, got {mixed_precision!r}"
            )
        self.cuda_id, self.sync_bn, self.timeout, self.blocks = cuda_id, sync_bn, timeout, blocks
        self.mixed_precision, self.cpu_offload = mixed_precision, cpu_offload
        self.find_unused_parameters = find_unused_parameters
        self.check_data = check_data  # False: ranks may hold different data on purpose (same lengths)
        self.backend = backend  # "gloo": train on the CPU even where CUDA is available
        self.reshard_after_forward = reshard_after_forward
        self.release_memory = release_memory
        self.active = False
        self._sync = True
        self._failed = False
        self._twin: nn.Module | None = None
        #: Which parameters required a gradient when they were sharded (None: not sharded).
        self.trainable: tuple[bool, ...] | None = None

    @property
    def checkpoint_format(self) -> str:
        """ "dcp" while the model is sharded (every rank writes its own shards), else "file"."""
        return "dcp" if is_sharded(self.learn.model) else "file"

    # ---- set up and put back ----------------------------------------------------------
    def setup(self, parts: TrainingParts) -> TrainingParts:
        learn = self.learn
        self.created_group = setup_distrib(self.cuda_id, timeout=self.timeout, backend=self.backend)
        self._before = replace(parts, model=learn.raw_model)  # (the host still holds parts.model)
        if not group_active() or dist.get_world_size() == 1:
            # One process: nothing to shard, but it trains on its GPU (`--gpus 0`), as DDP's does.
            device = training_device(learn, self.cuda_id, self.backend)
            if device.type == "cuda":
                torch.cuda.set_device(device)
                place_training_state(parts.model, parts.opt, learn.loss_func, device)
            return parts
        try:
            sharded = self._shard(self._before)
        except BaseException:
            self.restore()  # a refused setup leaves the model as it was, and no group behind
            self.leave()
            raise
        self.active = True
        return sharded

    def _policies(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        mp = self.mixed_precision
        if isinstance(mp, str):
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[mp], reduce_dtype=torch.float32)
        if mp is not None:
            kwargs["mp_policy"] = mp
        if self.cpu_offload:
            # Pinned memory needs an accelerator; on a CPU-only machine offload is a plain copy.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return kwargs

    def _shard(self, parts: TrainingParts) -> TrainingParts:
        learn = self.learn
        original = parts.model
        device = training_device(learn, self.cuda_id, self.backend)
        collective = make_collective(learn, device, self.check_data)
        if device.type == "cuda":
            original.to(device)
        elif self.release_memory:
            return_freed_memory()
        # Keep the optimizer's state (a fit before this context) to move it onto the shards; not where it
        # holds none yet (torch would make some up by stepping it once with zero gradients).
        opt_state = get_optimizer_state_dict(original, parts.opt) if parts.opt and parts.opt.state else None
        # The twin shares the user's Parameter and buffer objects: no second copy of the weights.
        shared = {id(t): t for t in (*original.parameters(), *original.buffers())}
        twin = copy.deepcopy(original, memo=shared)
        if self.sync_bn:
            twin = convert_sync_batchnorm(twin)
        # The mesh names the device: torch's default is the machine's accelerator even when
        # this job trains on CPU over gloo.
        kwargs = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),)), **self._policies()}
        mp = kwargs.get("mp_policy")
        if mp is not None and mp.param_dtype not in (None, torch.float32):
            # A BatchNorm under a lower-precision parameter policy fails (its running statistics stay
            # float32: "mixed dtype ... expect parameter to have scalar type of Float") or, where a
            # kernel accepts it, rounds its statistics; FSDP1 kept BatchNorm in float32 for this
            # reason, FSDP2 leaves it to the user. So each one keeps float32 parameters and reduction,
            # its input cast up and its output cast back to the compute dtype.
            float32 = MixedPrecisionPolicy(
                torch.float32, torch.float32, mp.param_dtype, cast_forward_inputs=True
            )
            for norm in (m for m in twin.modules() if isinstance(m, _BatchNorm)):  # leaves first: bottom-up
                fully_shard(norm, **{**kwargs, "mp_policy": float32})
        for block in reversed(select_blocks(twin, self.blocks)):  # bottom-up, as fully_shard requires
            fully_shard(block, **kwargs)
        fully_shard(twin, **kwargs)
        assert isinstance(twin, FSDPModule)
        if self.find_unused_parameters:
            twin.set_reduce_scatter_unused_params(True)
        self._twin = twin
        self.trainable = trainable_set(twin)
        # The shards are copies: free the user's full weights while the twin trains.
        for param in original.parameters():
            param.data = param.data.new_empty(0)
        opt = None
        if parts.opt is not None:
            opt = _rebuilt_optimizer(learn, original, twin, parts.opt, opt_state)
        self.monitor = RankMonitor(self.timeout)
        return TrainingParts(twin, opt, collective, shared_seed(collective, parts.data_seed))

    def restore(self) -> TrainingParts:
        """Gather the trained weights back into the user's plain model; drop the sharded optimizer."""
        self._stop_monitor()
        before, opt = self._before, self.learn.opt
        twin, self._twin, self.trainable = self._twin, None, None
        if twin is not None:
            if not self._sync:
                cast(FSDPModule, twin).set_requires_gradient_sync(True)
            try:
                weights = get_model_state_dict(twin, options=_FULL)
            except Exception as exc:
                if not self._failed:
                    raise
                # The block already failed (a rank died or stalled): its error is the one to see.
                warnings.warn(
                    f"the sharded weights could not be gathered back ({type(exc).__name__}): the model's "
                    "parameters are empty; load the last checkpoint",
                    stacklevel=2,
                )
                weights = {}
            for name, param in before.model.named_parameters():
                if name in weights:
                    param.data = cast(torch.Tensor, weights[name]).to(param.dtype)
            # Not gathered: the optimizer state (twice the weights, for Adam) would make the end of
            # training the peak of memory on every rank. The next fit starts a fresh optimizer;
            # a checkpoint or `save` made inside the context keeps the state.
            opt = None
        self.active = False
        return replace(before, opt=opt, data_seed=self.learn.data_seed)

    # ---- the loop ---------------------------------------------------------------------
    def before_batch(self) -> None:
        if not self.active:
            return
        self._at(0)
        # Accumulation micro-steps keep their gradients local: one reduce-scatter per step.
        sync = self.learn.grad_sync or not self.learn.training
        if sync != self._sync:
            cast(FSDPModule, self.learn.model).set_requires_gradient_sync(sync)
            self._sync = sync

    def diagnose(self) -> RankStalledError | None:
        """After the `with` block failed: the rank that stopped taking part, if another one did.

        Also remembers the failure, so that `restore` does not let a failing gather hide it."""
        self._failed = True
        return super().diagnose()

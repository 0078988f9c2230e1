"""Synchronised BatchNorm that works on any device and backend, gloo on CPU included.

`torch.nn.SyncBatchNorm` refuses CPU tensors. `SyncBatchNorm` here normalises with
the statistics of the union of all ranks' batches using two small collectives per
layer and step (one all_gather of the statistics forward, one all_gather of the gradient
sums backward), so a DDP model trains as one process would on the global batch.
`convert_sync_batchnorm` / `revert_sync_batchnorm` swap layers in and out while keeping the
very same Parameter and buffer objects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

# torch 2.13 names the flat all-gather `all_gather_single`; 2.11 has only the older name (deprecated in 2.13).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = [
    "BatchNormNd",
    "SyncBatchNorm",
    "buffers_synchronised",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx: the attributes set on it below are ours
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        factor: float,
        group: Any,
        world_size: int,
    ) -> Tensor:
        # float32 at least: half-precision sums of large batches lose the statistics.
        cdtype = torch.promote_types(x.dtype, torch.float32)
        channels = x.shape[1]
        xf = x.to(cdtype)
        count = x.numel() // channels
        if count > 0:  # torch's fused (Welford) CPU/CUDA kernel: mean and biased variance in one pass
            mean, var = torch.batch_norm_update_stats(xf, None, None, 0.0)
        else:  # an empty rank contributes zero weight below, never a NaN
            mean = var = torch.zeros(channels, dtype=cdtype, device=x.device)
        packed = torch.cat([mean.new_full((1,), float(count)), mean, var])
        gathered = _every_rank(packed, group, world_size)
        counts, means, variances = gathered[:, :1], gathered[:, 1 : 1 + channels], gathered[:, 1 + channels :]
        total = float(counts.sum())
        if total <= 1:  # same check, on every rank, as F.batch_norm in training
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)}")
        # Chan et al.'s parallel combine: within-rank spread plus spread of the rank means.
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (variances + (means - g_mean).square())).sum(0) / total
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None and running_var is not None:
            # As torch's BatchNorm for one batch of `total` values: unbiased var in the buffer.
            running_mean.lerp_(g_mean.to(running_mean.dtype), factor)
            running_var.lerp_((g_var * (total / (total - 1))).to(running_var.dtype), factor)
        # Eval-mode batch_norm normalises with the statistics it is given: one fused pass.
        y = F.batch_norm(xf, g_mean, g_var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, g_mean, g_var, invstd)
        ctx.total, ctx.group, ctx.world, ctx.eps = total, group, world_size, eps
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        """On torch's fused kernels: ~one pass over the data, as plain BatchNorm's.

        Eval-mode `native_batch_norm_backward` with the global statistics gives, in one call,
        `w * invstd * dy` and this rank's `sum(dy * xhat)`, `sum(dy)`. The input gradient of a
        batch norm also depends on those sums over *all* ranks (every sample moved the mean and
        variance): after one all_reduce they enter as a per-channel affine correction.
        """
        x, weight, mean, var, invstd = ctx.saved_tensors
        w = weight if weight is not None else torch.ones_like(mean)
        if x.numel():
            grad_in, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy.to(x.dtype).contiguous(), x, w, mean, var, None, None, False, ctx.eps, [True, True, True]
            )
        else:  # an empty rank (torch's kernel would divide by its zero count) adds zero sums below
            grad_in, sum_dy_xhat, sum_dy = torch.zeros_like(x), torch.zeros_like(mean), torch.zeros_like(mean)
        # Local sums, like torch's SyncBatchNorm: each rank's backward carries only its own loss
        # term, and DDP's mean over ranks of these gives d(mean of rank losses)/d(weight, bias).
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Every sample moved the global mean and var, so dx needs the sums of all ranks.
            # Summed in rank order, the same on every rank.
            sums = _every_rank(torch.cat([sum_dy, sum_dy_xhat]), ctx.group, ctx.world).sum(0)
            g_sum_dy, g_sum_dy_xhat = sums.chunk(2)
            # dx = w*invstd*(dy - S1/N - xhat*S2/N) = grad_in - k2*x - k1, per channel
            k2 = w * invstd * invstd * g_sum_dy_xhat / ctx.total
            k1 = w * invstd * g_sum_dy / ctx.total - k2 * mean
            grad_x = grad_in.addcmul_(x, _bcast(-k2, x)).sub_(_bcast(k1, x))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _every_rank(t: Tensor, group: Any, world_size: int) -> Tensor:
    """Every rank's small flat `t`, a row each: one collective into one flat buffer (no per-rank
    list of views for gloo to copy through). Summed after, it beats an all_reduce: for a few hundred
    floats gloo's all_gather answers about twice as fast (benchmarks/sync_bn_profile.py: 618 against
    1483 us median on 2 processes)."""
    gathered = t.new_empty(world_size, t.numel())
    _all_gather_flat(gathered.view(-1), t, group=group)
    return gathered


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    """A per-channel vector shaped to broadcast over an (N, C, *) tensor."""
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


class BatchNormNd(_BatchNorm):
    """Plain BatchNorm for any (N, C, *) input: what `revert_sync_batchnorm` turns a
    SyncBatchNorm into when no original BatchNorm1d/2d/3d class was recorded."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


class SyncBatchNorm(BatchNormNd):
    """BatchNorm over the union of every rank's batch, for any (N, C, *) input; any device, any
    backend (gloo too).

    Batch statistics are synchronised whenever they are used (training, or eval without
    running stats) and the group has more than one rank; otherwise it is exactly
    `F.batch_norm`. Weight and bias gradients are this rank's share, as in torch's
    SyncBatchNorm, so that DDP's gradient average yields single-process training on the
    global batch. Ranks may hold different (even zero) batch sizes. Note: every rank of
    the group must call forward (and backward) together, as for any collective.

    >>> bn = SyncBatchNorm(16)                   # or convert_sync_batchnorm(model)
    >>> y = bn(torch.randn(8, 16, 4, 4))         # no group / one rank: plain BatchNorm
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if affine and not bias:  # set here, not via super(): older torch lacks `bias=`
            self.register_parameter("bias", None)
        self.process_group = process_group

    def _sync_group(self) -> tuple[Any, int] | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group == dist.GroupMember.NON_GROUP_MEMBER:  # not in the given group: nobody to sync with
            return None
        world_size = dist.get_world_size(group)
        return (group, world_size) if world_size > 1 else None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"expected {self.num_features} channels, got input of shape {tuple(input.shape)}"
            )
        # Same rules as torch's BatchNorm: batch stats in training or when there are no buffers.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        sync = self._sync_group() if use_batch_stats else None
        if sync is None:  # nothing to synchronise: torch's BatchNorm, as it is
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        keep = not self.training or self.track_running_stats
        running_mean = self.running_mean if keep else None
        running_var = self.running_var if keep else None
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, *sync
        )


def _rebuild(src: nn.Module, cls: type[nn.Module], drop: tuple[str, ...] = (), **extra: Any) -> nn.Module:
    """A new `cls` instance with `src`'s whole state: the same Parameter and buffer objects,
    mode, hooks, qconfig and any other attribute; registries are copied, not shared, so the
    old module stays intact. Bypasses __init__, so subclasses with other signatures work."""
    new = cls.__new__(cls)
    state = {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in vars(src).items() if k not in drop}
    vars(new).update(state, **extra)
    return new


def convert_sync_batchnorm(module: nn.Module, process_group: Any | None = None) -> nn.Module:
    """Replace every BatchNorm layer in `module` with a synchronised one.

    Layers on CUDA become `torch.nn.SyncBatchNorm` (its fused kernels); all others become
    unison's `SyncBatchNorm`. The new layers hold the same Parameter and buffer objects, so
    an optimizer built earlier keeps working. Returns the root (new if `module` is a BN).

        model = convert_sync_batchnorm(model)    # before wrapping in DDP
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{type(module).__name__} is uninitialised: run one forward pass first")
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        cls = nn.SyncBatchNorm if any(t.is_cuda for t in tensors) else SyncBatchNorm
        out = _rebuild(module, cls, process_group=process_group, _unison_original_cls=type(module))
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def buffers_synchronised(module: nn.Module) -> bool:
    """Whether every buffer of `module` belongs to a BatchNorm synchronised over the whole world.

    Such buffers (running mean, var, batch count) are updated on every rank from the same
    gathered statistics by the same operations, so they stay bitwise equal: DDP's
    `forward_sync_buffers` (a broadcast before every forward) would copy equal
    bytes. `DistributedTrainer` turns it off when this holds and the user did not set it.
    A module with any other buffer, or a BatchNorm scoped to a sub-group, answers False.

    >>> buffers_synchronised(convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))))
    True
    """
    owned = 0
    for layer in module.modules():
        if isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)) and layer.process_group is None:
            owned += sum(1 for _ in layer.buffers(recurse=False))
    return owned == sum(1 for _ in module.buffers())


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo `convert_sync_batchnorm`: each SyncBatchNorm (unison's or torch's) becomes its
    recorded original class, or `BatchNormNd` (any input rank) when none was recorded,
    sharing the same Parameter and buffer objects. Returns the (possibly new) root.

        model = revert_sync_batchnorm(convert_sync_batchnorm(model))   # types as before
    """
    out = module
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        cls = getattr(module, "_unison_original_cls", None) or BatchNormNd
        out = _rebuild(module, cls, drop=("process_group", "_unison_original_cls"))
    for name, child in module.named_children():
        out.add_module(name, revert_sync_batchnorm(child))
    return out

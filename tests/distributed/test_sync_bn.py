from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from unison.distributed.sync_bn import (
    BatchNormNd,
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)

TOL = 1e-5
BN_CLS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.inner = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6, momentum=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.relu(self.bn(self.conv(x))))


def _bn_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _absmax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---------------------------------------------------------------- convert / revert, one process


def test_convert_revert_round_trip_keeps_objects_types_and_state():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.BatchNorm1d(6, affine=False), nn.Linear(6, 2))
    model[0].bn.eval()
    model[0].bn.bias.requires_grad_(False)
    model[0].bn.qconfig = "marker"
    types = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    synced = convert_sync_batchnorm(model)
    assert synced is model  # the root is not a BN, it is edited in place
    assert all(type(m) is SyncBatchNorm for m in _bn_layers(synced).values()) and len(_bn_layers(synced)) == 3
    assert all(p is params[n] for n, p in synced.named_parameters())
    assert all(b is buffers[n] for n, b in synced.named_buffers())
    bn = synced[0].bn
    assert not bn.training and not bn.bias.requires_grad and bn.qconfig == "marker"
    assert synced[0].inner[2].momentum is None and synced[1].weight is None
    assert convert_sync_batchnorm(synced[0].bn) is synced[0].bn  # already synced: left alone

    # An optimizer built before the conversion trains the converted model.
    synced.train()
    synced(torch.randn(4, 3, 5, 5)).square().sum().backward()
    opt.step()
    assert (synced[0].conv.weight != before["0.conv.weight"]).any()
    assert (synced[0].bn.weight != before["0.bn.weight"]).any()
    assert int(synced[0].bn.num_batches_tracked) == 1

    trained = {k: v.clone() for k, v in synced.state_dict().items()}
    reverted = revert_sync_batchnorm(synced)
    assert {n: type(m) for n, m in reverted.named_modules()} == types
    assert all(p is params[n] for n, p in reverted.named_parameters())
    assert all(b is buffers[n] for n, b in reverted.named_buffers())
    assert _max_diff(reverted.state_dict(), trained) == 0
    assert reverted[0].bn.qconfig == "marker" and not hasattr(reverted[0].bn, "process_group")

    # Without training in between, state_dict is exactly as before.
    fresh = nn.Sequential(Block(), nn.BatchNorm3d(2))
    sd = {k: v.clone() for k, v in fresh.state_dict().items()}
    back = revert_sync_batchnorm(convert_sync_batchnorm(fresh))
    assert type(back[1]) is nn.BatchNorm3d and _max_diff(back.state_dict(), sd) == 0


def test_root_bn_and_foreign_sync_bn():
    bn = nn.BatchNorm2d(3)
    synced = convert_sync_batchnorm(bn, process_group=None)
    assert type(synced) is SyncBatchNorm and synced.weight is bn.weight
    assert synced._unison_original_cls is nn.BatchNorm2d
    assert type(revert_sync_batchnorm(synced)) is nn.BatchNorm2d
    foreign = nn.SyncBatchNorm(3)  # no recorded class: becomes a BN that takes any input rank
    plain = revert_sync_batchnorm(foreign)
    assert type(plain) is BatchNormNd and plain.running_mean is foreign.running_mean
    assert plain(torch.randn(4, 3, 2, 2, 2)).shape == (4, 3, 2, 2, 2)


# ---------------------------------------------------------------- numerics, one process


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 5), (6, 3, 4, 5)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_group_matches_batchnorm(shape, momentum):
    torch.manual_seed(1)
    ref = BN_CLS[max(len(shape) - 2, 1)](3, momentum=momentum)
    nn.init.normal_(ref.weight), nn.init.normal_(ref.bias)
    sbn = convert_sync_batchnorm(BN_CLS[max(len(shape) - 2, 1)](3, momentum=momentum))
    sbn.load_state_dict(ref.state_dict())
    for _ in range(2):
        x = torch.randn(shape) * 3 + 1
        g = torch.randn(shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out = ref(x1), sbn(x2)
        (out_ref * g).sum().backward()
        (out * g).sum().backward()
        assert torch.allclose(out, out_ref, atol=TOL)
        assert torch.allclose(x1.grad, x2.grad, atol=TOL)
    assert torch.allclose(ref.weight.grad, sbn.weight.grad, atol=TOL)
    assert torch.allclose(ref.bias.grad, sbn.bias.grad, atol=TOL)
    assert _max_diff(ref.state_dict(), sbn.state_dict()) < TOL
    ref.eval(), sbn.eval()
    x = torch.randn(shape)
    assert torch.allclose(ref(x), sbn(x), atol=TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layers_become_torch_sync_bn():
    model = nn.Sequential(nn.BatchNorm2d(3)).cuda()
    weight = model[0].weight
    synced = convert_sync_batchnorm(model)
    assert type(synced[0]) is nn.SyncBatchNorm and synced[0].weight is weight and weight.is_cuda
    assert type(revert_sync_batchnorm(synced)[0]) is nn.BatchNorm2d


def test_half_input_keeps_dtype():
    x = torch.randn(8, 4, 3, 3)
    out = SyncBatchNorm(4)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), nn.BatchNorm2d(4)(x), atol=5e-2)


# ---------------------------------------------------------------- against one BN on the global batch


def _rank_rows(n_global: int, sizes: list[int] | None) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    if sizes is None:  # interleaved slices of equal size
        return torch.arange(rank, n_global, world)
    start = sum(sizes[:rank])
    return torch.arange(start, start + sizes[rank])


def _sync_vs_global(shape: tuple[int, ...], sizes: list[int] | None, momentum: float | None, train: bool):
    """Two steps of SyncBatchNorm on this rank's rows vs. one BN on all rows; returns max diffs."""
    world = dist.get_world_size()
    n = shape[0]
    gen = torch.Generator().manual_seed(7)
    c = shape[1]
    ref = BN_CLS[max(len(shape) - 2, 1)](c, momentum=momentum, track_running_stats=train)
    with torch.no_grad():
        ref.weight.normal_(generator=gen), ref.bias.normal_(generator=gen)
    sbn = convert_sync_batchnorm(BN_CLS[max(len(shape) - 2, 1)](c, momentum=momentum))
    sbn.track_running_stats = train
    if not train:  # eval without running stats: batch statistics, synchronised too
        sbn.running_mean = sbn.running_var = sbn.num_batches_tracked = None
    sbn.load_state_dict(ref.state_dict())
    ref.train(train), sbn.train(train)
    rows = _rank_rows(n, sizes)
    diffs = {"out": 0.0, "dx": 0.0, "dw": 0.0, "db": 0.0}
    for step in range(2):
        x = torch.randn(shape, generator=gen) * (step + 2) + 5  # offset: exercises the stable variance
        g = torch.randn(shape, generator=gen)
        xg, xl = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        out_ref = ref(xg)
        (out_ref * g).sum().backward()
        out = sbn(xl)
        (out * g[rows]).sum().backward()
        diffs["out"] = max(diffs["out"], _absmax(out - out_ref[rows]))
        diffs["dx"] = max(diffs["dx"], _absmax(xl.grad - xg.grad[rows]))
    # DDP averages parameter gradients: all_reduce(SUM) / world == d(global loss / world).
    for key, p, p_ref in (("dw", sbn.weight, ref.weight), ("db", sbn.bias, ref.bias)):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        diffs[key] = float((grad / world - p_ref.grad / world).abs().max())
    if train:
        diffs["state"] = _max_diff(sbn.state_dict(), ref.state_dict())
        diffs["batches"] = int(sbn.num_batches_tracked)
    return diffs


CASES = {
    "2d-interleaved": ((12, 3, 4, 5), None, 0.1, True),
    "1d-NC": ((12, 5), None, 0.1, True),
    "1d-NCL": ((12, 4, 7), None, 0.3, True),
    "cumulative-momentum": ((12, 3, 2, 2), None, None, True),
    "3d": ((6, 2, 2, 3, 2), None, 0.1, True),
    "eval-without-running-stats": ((12, 3, 4), None, 0.1, False),
}


@pytest.mark.parametrize("pool_name", ["pool2", "pool3"])
@pytest.mark.parametrize("case", CASES)
def test_matches_single_bn_on_global_batch(request, pool_name, case):
    pool = request.getfixturevalue(pool_name)
    for diffs in pool.run(_sync_vs_global, *CASES[case]):
        assert diffs.pop("batches", 2) == 2
        assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize("pool_name, sizes", [("pool2", [7, 2]), ("pool3", [5, 0, 4]), ("pool3", [1, 1, 0])])
def test_unequal_and_empty_rank_batches(request, pool_name, sizes):
    pool = request.getfixturevalue(pool_name)
    for diffs in pool.run(_sync_vs_global, (sum(sizes), 3, 4, 2), sizes, 0.1, True):
        assert diffs.pop("batches") == 2
        assert max(diffs.values()) < TOL, diffs


def _one_value_in_total():
    x = torch.randn(1 - dist.get_rank(), 2)  # one sample on rank 0, none on rank 1
    try:
        SyncBatchNorm(2)(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_one_value_per_channel_in_total_raises_on_every_rank(pool2):
    assert all("more than 1 value" in msg for msg in pool2.run(_one_value_in_total))


def _bf16_sync():
    rows = _rank_rows(8, None)
    x = torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(5))
    xl = x[rows].to(torch.bfloat16).requires_grad_()
    out = SyncBatchNorm(3)(xl)
    out.float().sum().backward()
    ref = nn.BatchNorm1d(3)(x)[rows]
    return out.dtype, xl.grad.dtype, _absmax(out.float() - ref)


def test_bfloat16_input_syncs_in_float32_and_returns_bfloat16(pool2):
    for out_dtype, grad_dtype, diff in pool2.run(_bf16_sync):
        assert out_dtype == grad_dtype == torch.bfloat16 and diff < 5e-2


# ---------------------------------------------------------------- DDP end to end


def _conv_bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2)
    )


def _ddp_vs_single(steps: int = 3, per_rank: int = 4):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(11)
    data = [
        (
            torch.randn(per_rank * world, 3, 5, 5, generator=gen),
            torch.randn(per_rank * world, 2, 5, 5, generator=gen),
        )
        for _ in range(steps)
    ]
    single = _conv_bn_net()
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(single(x), y).backward()
        opt.step()

    ddp = nn.parallel.DistributedDataParallel(convert_sync_batchnorm(_conv_bn_net()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
        opt.step()
    return _max_diff(ddp.module.state_dict(), single.state_dict())


def test_ddp_training_equals_single_process_on_global_batch(pool2):
    assert max(pool2.run(_ddp_vs_single)) < TOL


# ---------------------------------------------------------------- eval mode and process groups


def _eval_uses_running_stats():
    rank = dist.get_rank()
    sbn = SyncBatchNorm(3)
    with torch.no_grad():
        sbn.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        sbn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    sbn.eval()
    x = torch.randn(2 + rank, 3, 4)
    # Rank 1 runs one more forward than rank 0: had eval issued a collective, the ranks
    # would be out of step and the barrier below would fail or time out.
    for _ in range(1 + rank):
        out = sbn(x)
    dist.barrier()
    ref = nn.functional.batch_norm(x, sbn.running_mean, sbn.running_var, sbn.weight, sbn.bias, False)
    return float((out - ref).abs().max()), int(sbn.num_batches_tracked)


def test_eval_uses_running_stats_without_collective(pool2):
    assert pool2.run(_eval_uses_running_stats) == [(0.0, 0), (0.0, 0)]


def _subgroup_means():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # every rank must call new_group; rank 2 is outside
    sbn = SyncBatchNorm(1, affine=False, momentum=1.0, process_group=group)
    sbn(torch.full((2, 1), float(rank)) + torch.tensor([[-1.0], [1.0]]))
    if rank < 2:
        dist.destroy_process_group(group)
    return float(sbn.running_mean)


def test_process_group_scopes_the_statistics(pool3):
    # Ranks 0 and 1 share their mean (0.5); rank 2, outside the group, keeps its own.
    assert pool3.run(_subgroup_means) == [0.5, 0.5, 2.0]


# ---------------------------------------------------------------- what a training step costs


def _training_collectives():
    """Two epochs under distrib_ctx() (exact BatchNorm): the collectives the second epoch's training
    steps issued (from each batch's start to its optimizer step; the first epoch has one-time
    collectives: the loader's seed, DDP's bucket rebuild), and whether the buffers match across ranks."""
    import contextlib
    import io
    from collections import Counter

    from torch.profiler import profile

    from tests.distributed.test_trainer import _bn_model, _learner
    from unison import Callback

    ops: Counter[str] = Counter()

    class CountSteps(Callback):
        prof = None

        def before_batch(self):
            if self.learn.training and self.learn.epoch == 1:
                self.prof = profile()
                self.prof.__enter__()

        def after_step(self):
            if self.prof is None:
                return
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
            ops.update(e.name for e in prof.events() if e.name.startswith("c10d::"))
            ops["steps"] += 1

    learn = _learner(_bn_model, bs=8, cbs=[CountSteps()])
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        learn.fit(2)
    buffers = torch.cat([b.double().flatten() for b in learn.model.buffers()])
    everyone = [torch.empty_like(buffers) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, buffers)
    equal = all(torch.equal(buffers, b) for b in everyone)
    gathers = sum(n for name, n in ops.items() if "allgather" in name)
    return ops["steps"], ops["c10d::broadcast_"], gathers, equal


def test_exact_batchnorm_training_issues_no_buffer_broadcast(pool2):
    # Every buffer is a SyncBatchNorm's, updated from the same gathered statistics on every rank:
    # DDP's broadcast of them before every forward (forward_sync_buffers) would only copy
    # equal bytes. Two all_gathers per BN layer per step remain, and the buffers stay bitwise equal.
    # 48 samples, 2 ranks x 8 a batch: 3 steps an epoch; one BatchNorm layer: its statistics in
    # forward and its gradient sums in backward, one all_gather each (gloo answers small gathers
    # faster than all_reduce).
    assert pool2.run(_training_collectives) == [(3, 0, 6, True)] * 2

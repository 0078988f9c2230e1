"""Sharded training (FSDP2) on real gloo groups: parity with one process and with DDP; blocks."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from tests.hangs import run_or_report
from unison import (
    Callback,
    DataLoaders,
    GradientAccumulation,
    GradientClip,
    Learner,
    TokenCrossEntropy,
    accuracy,
    set_seed,
)
from unison.distributed import ShardedTrainer, SyncBatchNorm
from unison.distributed.sharded import is_sharded, return_freed_memory, select_blocks

N_TRAIN = 48  # a multiple of W * bs for W = 2 and 3 (bs = 8)


class TinyTransformer(nn.Module):
    """Two encoder layers over 4 tokens of 6 features, mean-pooled into 2 classes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        # No biases: a key bias gets only rounding noise as gradient (softmax ignores it), which
        # AdamW would blow up into steps of size lr, different on any two summation orders.
        layer = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x.view(len(x), 4, 6))).mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def _bn_model():
    # No bias before the BatchNorm: its gradient is rounding noise (BN removes the mean).
    return nn.Sequential(nn.Linear(24, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


class Tied(nn.Module):
    """Two layers sharing one weight matrix (as an embedding and an output layer may)."""

    def __init__(self):
        super().__init__()
        self.proj, self.a, self.b, self.head = (
            nn.Linear(24, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 2),
        )
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(torch.relu(self.proj(x)))))))


MODELS = {"mlp": _mlp, "bn": _bn_model, "transformer": TinyTransformer, "tied": Tied}


def _data(n_train=N_TRAIN, n_valid=37):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + n_valid, 24, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 7] > 0).long()
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def _learner(model_name, bs, opt="adamw", cbs=()):
    set_seed(0)  # same init and same data seed on every rank and in the baseline
    train, valid = _data()
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=8))
    if opt == "sgd":
        opt_func = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    elif opt == "plain-sgd":
        opt_func = torch.optim.SGD
    else:
        opt_func = lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)  # noqa: E731
    lr = 0.01 if opt == "adamw" else 0.05
    model = MODELS[model_name]()
    return Learner(dls, model, nn.CrossEntropyLoss(), opt_func=opt_func, lr=lr, metrics=[accuracy], cbs=cbs)


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _extra(name):
    return {"": [], "acc": [GradientAccumulation(2)], "clip": [GradientClip(0.05)]}[name]


def _fit(learn, n=2, **ctx):
    with contextlib.redirect_stdout(io.StringIO()):
        with learn.distrib_ctx(**ctx):
            sharded_inside = is_sharded(learn.model)
            dtensors = all(isinstance(p, DTensor) for p in learn.model.parameters())
            learn.fit(n)
            valid = learn.validate()
            preds, _ = learn.get_preds()
        return {"sharded": sharded_inside and dtensors, "valid": valid, "preds": preds}


def _parity(model_name, opt, extra):
    world = dist.get_world_size()
    single = _learner(model_name, bs=8 * world, opt=opt, cbs=_extra(extra))
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
        expected_valid = single.validate()
        expected_preds, _ = single.get_preds()
    multi = _learner(model_name, bs=8, opt=opt, cbs=_extra(extra))
    user_model = multi.model
    got = _fit(multi, shard=True)
    return {
        "sharded": got["sharded"],
        "diff": _max_diff(_weights(single), _weights(multi)),
        "valid_diff": max(abs(a - b) for a, b in zip(expected_valid, got["valid"], strict=True)),
        "preds_diff": float((expected_preds - got["preds"]).abs().max()),
        # after the block: the user's own model object, plain tensors, a plain optimizer
        "restored": multi.model is user_model
        and not is_sharded(multi.model)
        and not any(isinstance(p, DTensor) for p in multi.model.parameters())
        and multi.opt is None,  # the sharded optimizer state is not gathered (a memory peak)
    }


def _check(results):
    for r in results:
        assert r["sharded"] and r["restored"]
        assert r["diff"] < 1e-5, r
        assert r["valid_diff"] < 1e-5 and r["preds_diff"] < 1e-5, r


def test_parity_mlp_adamw_and_sgd(pool2):
    _check(pool2.run(_parity, "mlp", "adamw", ""))
    _check(pool2.run(_parity, "mlp", "sgd", ""))


def test_parity_transformer(pool2):
    _check(pool2.run(_parity, "transformer", "adamw", ""))


def test_parity_batchnorm_synced(pool2):
    _check(pool2.run(_parity, "bn", "sgd", ""))


def test_parity_gradient_accumulation_and_clipping(pool2):
    _check(pool2.run(_parity, "mlp", "adamw", "acc"))
    _check(pool2.run(_parity, "transformer", "sgd", "clip"))


class _GradsAfterBackward(Callback):
    """Records, per training batch, whether the sharded gradients exist right after backward."""

    def __init__(self):
        self.seen = []

    def after_backward(self):
        self.seen.append(all(p.grad is not None for p in self.learn.model.parameters()))


def _no_reduce_on_micro_steps():
    probe = _GradsAfterBackward()
    learn = _learner("mlp", bs=8, cbs=[GradientAccumulation(2), probe])
    _fit(learn, n=1, shard=True)
    return probe.seen


def test_accumulation_reduces_only_on_steps(pool2):
    # 48 samples / (2 ranks x 8) = 3 batches: micro-step, step, and the epoch's last batch steps
    for seen in pool2.run(_no_reduce_on_micro_steps):
        assert seen == [False, True, True]


def test_parity_three_ranks(pool3):
    _check(pool3.run(_parity, "bn", "adamw", ""))


def _sharded_vs_ddp():
    ddp = _learner("transformer", bs=8)
    with contextlib.redirect_stdout(io.StringIO()), ddp.distrib_ctx():
        ddp.fit(2)
    sharded = _learner("transformer", bs=8)
    _fit(sharded, shard=True)
    return _max_diff(_weights(ddp), _weights(sharded))


def test_sharded_equals_ddp(pool2):
    assert max(pool2.run(_sharded_vs_ddp)) < 1e-5


def _memory_and_sync_bn():
    learn = _learner("bn", bs=8)
    total = sum(p.numel() for p in learn.model.parameters())
    with learn.distrib_ctx(shard=True):
        local = sum(p.to_local().numel() for p in learn.model.parameters())
        sync_bn = isinstance(learn.model[1], SyncBatchNorm)
        freed = all(p.numel() == 0 for p in learn.get_cb(ShardedTrainer)._before.model.parameters())
    return {"total": total, "local": local, "sync_bn": sync_bn, "freed": freed}


def test_each_rank_holds_its_shard_only(pool2):
    results = pool2.run(_memory_and_sync_bn)
    for r in results:
        assert r["sync_bn"] and r["freed"]
    assert sum(r["local"] for r in results) >= results[0]["total"]
    assert max(r["local"] for r in results) <= results[0]["total"] // 2 + 16  # dim-0 shards, padded


def test_block_policy():
    blocks = select_blocks(TinyTransformer())
    assert [type(b).__name__ for b in blocks] == [
        "Linear",
        "TransformerEncoderLayer",
        "TransformerEncoderLayer",
        "Linear",
    ]
    assert len(select_blocks(TinyTransformer(), [nn.TransformerEncoderLayer])) == 2
    assert len(select_blocks(_mlp(), lambda m: isinstance(m, nn.Linear) and m.out_features == 16)) == 2
    bn = _bn_model()
    assert select_blocks(bn) == [bn[0], bn[3]]  # the BatchNorm stays with the root
    tied = Tied()
    assert select_blocks(tied) == [tied.proj, tied.head]  # a and b share a weight: both stay with the root


def test_parity_tied_weights(pool2):
    _check(pool2.run(_parity, "tied", "adamw", ""))


@pytest.mark.launch
def test_readme_example_trains_sharded_on_two_processes(tmp_path):
    """examples/train_sharded.py under `unison launch --nproc 2`: learns, checkpoints sharded, exports."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(script), "--out", str(tmp_path)]
    proc = run_or_report(cmd, 240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"valid_accuracy (\d\.\d+)", proc.stdout)
    assert len(found) == 1 and float(found[0]) >= 0.95, proc.stdout
    assert "equal to the trained model: True" in proc.stdout
    shards = sorted(p.name for p in (tmp_path / "models" / "checkpoint.dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    weights = torch.load(tmp_path / "models" / "weights.pth", weights_only=True)
    assert weights["head.weight"].shape == (2, 32)


def test_bad_options_are_refused_before_anything_changes():
    learn = _learner("mlp", bs=8)
    model = learn.model
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        learn.to_distributed(shard=True, mixed_precision="int8")
    with pytest.raises(ValueError, match="'fp16' is refused"):
        learn.to_distributed(shard=True, mixed_precision="fp16")
    with pytest.raises(TypeError, match="blocks must be nn.Module classes"):
        learn.to_distributed(shard=True, blocks=5)
    with pytest.raises(TypeError, match="blocks must be nn.Module classes"):
        learn.to_distributed(shard=True, blocks=["Linear"])
    assert learn.model is model and learn.get_cb(ShardedTrainer) is None


def test_one_process_outside_a_launch_trains_plainly():
    a, b = _learner("mlp", bs=16), _learner("mlp", bs=16)
    with contextlib.redirect_stdout(io.StringIO()):
        a.fit(1)
        with b.distrib_ctx(shard=True):
            assert not is_sharded(b.model)
            b.fit(1)
    assert _max_diff(_weights(a), _weights(b)) == 0


def _mixed_precision_offload_lr_find():
    world = dist.get_world_size()
    single = _learner("mlp", bs=8 * world)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
    # bf16 compute, float32 weights and gradient reduction
    seen = []
    mixed = _learner("mlp", bs=8)
    mixed.model[2].register_forward_hook(lambda mod, inp, out: seen.append((inp[0].dtype, mod.weight.dtype)))
    with contextlib.redirect_stdout(io.StringIO()), mixed.distrib_ctx(shard=True, mixed_precision="bf16"):
        master = {p.dtype for p in mixed.model.parameters()}
        mixed.fit(2)
    # bf16 with BatchNorm: its parameters stay float32 (a bf16 BatchNorm would fail, or round its
    # statistics); the layers around it compute in bf16
    single_bn = _learner("bn", bs=8 * world, opt="sgd")
    with contextlib.redirect_stdout(io.StringIO()):
        single_bn.fit(2)
    bn_seen, after_bn = [], []
    mixed_bn = _learner("bn", bs=8, opt="sgd")
    mixed_bn.model[1].register_forward_hook(
        lambda mod, inp, out: bn_seen.append((inp[0].dtype, mod.weight.dtype))
    )
    mixed_bn.model[3].register_forward_hook(
        lambda mod, inp, out: after_bn.append((inp[0].dtype, mod.weight.dtype))
    )
    with contextlib.redirect_stdout(io.StringIO()), mixed_bn.distrib_ctx(shard=True, mixed_precision="bf16"):
        mixed_bn.fit(2)
    # CPU offload (a plain copy on a CPU machine): exact
    offload = _learner("mlp", bs=8)
    _fit(offload, shard=True, cpu_offload=True)
    # lr_find puts the sharded weights back as they were
    finder = _learner("mlp", bs=8)
    with contextlib.redirect_stdout(io.StringIO()), finder.distrib_ctx(shard=True):
        before = get_model_state_dict(finder.model, options=StateDictOptions(full_state_dict=True))
        finder.lr_find(num_it=3)
        after = get_model_state_dict(finder.model, options=StateDictOptions(full_state_dict=True))
    return {
        "master": master,
        "compute": set(seen),
        "mixed_diff": _max_diff(_weights(single), _weights(mixed)),
        "bn_compute": set(bn_seen),
        "after_bn_compute": set(after_bn),
        "bn_diff": _max_diff(_weights(single_bn), _weights(mixed_bn)),
        "offload_diff": _max_diff(_weights(single), _weights(offload)),
        "lr_find_restored": _max_diff(before, after),
    }


def test_mixed_precision_cpu_offload_and_lr_find(pool2):
    for r in pool2.run(_mixed_precision_offload_lr_find):
        assert r["master"] == {torch.float32}
        assert r["compute"] == {(torch.bfloat16, torch.bfloat16)}
        assert 0 < r["mixed_diff"] < 0.05  # trained like float32, with bfloat16 rounding
        assert r["bn_compute"] == {(torch.float32, torch.float32)}
        assert r["after_bn_compute"] == {(torch.bfloat16, torch.bfloat16)}
        assert 0 < r["bn_diff"] < 0.05
        assert r["offload_diff"] < 1e-5
        assert r["lr_find_restored"] == 0


ROUTES = []  # which expert each Routed forward took, on this rank


class Routed(nn.Module):
    """Two experts; each batch takes the one its mean picks, so ranks leave different ones unused."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        ROUTES.append(bool(x.mean() > 0))
        return torch.relu(self.a(x) if ROUTES[-1] else self.b(x))


def _routed():
    return nn.Sequential(nn.Linear(24, 16), Routed(), Routed(), nn.Linear(16, 2))


MODELS["routed"] = _routed


def _unused_vs_ddp():
    # Plain SGD: a parameter no rank used gets a zero gradient here and none under DDP, which
    # only momentum or weight decay would tell apart (see the README).
    ddp = _learner("routed", bs=8, opt="plain-sgd")
    with contextlib.redirect_stdout(io.StringIO()), ddp.distrib_ctx(find_unused_parameters=True):
        ddp.fit(2)
    sharded = _learner("routed", bs=8, opt="plain-sgd")
    ROUTES.clear()
    _fit(sharded, shard=True, find_unused_parameters=True)
    return _max_diff(_weights(ddp), _weights(sharded)), list(ROUTES)


def test_find_unused_parameters_matches_ddp(pool2):
    results = pool2.run(_unused_vs_ddp)
    (diff0, routes0), (diff1, routes1) = results
    assert routes0 != routes1  # the ranks did take different experts
    assert diff0 < 1e-5 and diff1 < 1e-5


def _opt_onto_shards(groups):
    """An optimizer that already stepped moves onto the shards: 1 + 1 epochs equal one process's.
    `groups`: a splitter's two param groups at discriminative LRs (`lr=slice(...)`)."""
    world = dist.get_world_size()
    learners = [_learner("mlp", bs=8 * world) for _ in range(2)]
    lr = slice(1e-3, 1e-2) if groups else None
    for learn in learners:
        learn.splitter = (lambda m: [m[:2].parameters(), m[2:].parameters()]) if groups else None
    single, multi = learners
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(1, lr=lr)
        single.fit(1, lr=lr)
        multi.fit(1, lr=lr)  # one process (every rank alike), then sharded with the same optimizer state
    multi.dls.train = DataLoader(multi.dls.train.dataset, batch_size=8, shuffle=True)
    with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx(shard=True):
        multi.fit(1, lr=lr)
        lrs = [group["lr"] for group in multi.opt.param_groups]
    return _max_diff(_weights(single), _weights(multi)), lrs


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "splitter-groups"])
def test_optimizer_state_moves_onto_the_shards(pool2, groups):
    """With a splitter's param groups too (they were rebuilt as one group at learn.lr)."""
    for diff, lrs in pool2.run(_opt_onto_shards, groups):
        assert diff < 1e-5 and lrs == ([1e-3, 1e-2] if groups else [0.01])


def test_return_freed_memory_respects_the_users_setting(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert return_freed_memory() is False  # the user decided: glibc is left alone
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert return_freed_memory() is (sys.platform == "linux")  # glibc accepted the setting


def _token_learner(bs, n_train):
    """Per-token logits scored by a token-mean `TokenCrossEntropy` with ignored (-100) labels."""
    set_seed(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_train + 11, 4, 6, generator=g)
    y = (x[..., 0] > 0).long() + (x[..., 1] > 0).long()
    y[torch.rand(y.shape, generator=g) < 0.3] = -100  # rows hold different numbers of scored tokens
    train, valid = TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=4))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt_func = lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)  # noqa: E731
    return Learner(dls, model, TokenCrossEntropy(), opt_func=opt_func, lr=0.01)


def _token_parity():
    # 33 items at a global batch of 16: the last global batch holds 1 item, rank 1's share is empty.
    single = _token_learner(16, 33)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
    multi = _token_learner(8, 33)
    with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx(shard=True):
        multi.fit(2)
    return (
        _max_diff(_weights(single), _weights(multi)),
        max(abs(a - b) for a, b in zip(single.recorder.values[-1], multi.recorder.values[-1], strict=True)),
        max(abs(a - b) for a, b in zip(single.recorder.losses, multi.recorder.losses, strict=True)),
    )


def test_parity_token_loss_with_an_uneven_last_batch(pool2):
    for weights, epoch_values, batch_losses in pool2.run(_token_parity):
        assert weights < 1e-5 and epoch_values < 1e-5 and batch_losses < 1e-5

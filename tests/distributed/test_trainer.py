"""DistributedTrainer on real gloo groups: parity with one process, exact evaluation, one voice."""

import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import (
    AccumMetric,
    Callback,
    DataLoaders,
    EarlyStopping,
    GradientAccumulation,
    Learner,
    accuracy,
    roc_auc,
    set_seed,
)
from unison.distributed import DistributedDataParallel, SyncBatchNorm, rank0_first

N_TRAIN = 48  # a multiple of W * bs for W = 2 and 3 (bs = 8): no padding in training


def _data(n_train=N_TRAIN, n_valid=101, features=6):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + n_valid, features, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _bn_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _learner(model_fn, bs, valid_bs=16, cbs=(), metrics=(accuracy,)):
    set_seed(0)  # same init and same data seed on every rank and in the baseline
    train, valid = _data()
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=valid_bs))
    opt = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    return Learner(dls, model_fn(), nn.CrossEntropyLoss(), opt_func=opt, lr=0.1, metrics=metrics, cbs=cbs)


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _parity(model_name, accumulate):
    model_fn = {"mlp": _mlp, "bn": _bn_model}[model_name]
    world = dist.get_world_size()
    extra = (lambda: [GradientAccumulation(2)]) if accumulate else (lambda: [])
    single = _learner(model_fn, bs=8 * world, cbs=extra())
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
    multi = _learner(model_fn, bs=8, cbs=extra())
    with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx(sync_bn=True):
        assert isinstance(multi.model, DistributedDataParallel)
        if model_name == "bn":
            assert isinstance(multi.model.module[1], SyncBatchNorm)
        multi.fit(2)
    assert type(multi.model[1]) is type(single.model[1])  # unwrapped and reverted on exit
    a, b = _weights(single), _weights(multi)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_parity_mlp(pool2):
    assert max(pool2.run(_parity, "mlp", False)) < 1e-5


def test_parity_batchnorm_sync_bn_on_cpu(pool2):
    assert max(pool2.run(_parity, "bn", False)) < 1e-5


def test_parity_gradient_accumulation_uses_no_sync(pool2):
    assert max(pool2.run(_parity, "mlp", True)) < 1e-5


def test_parity_three_ranks(pool3):
    assert max(pool3.run(_parity, "bn", False)) < 1e-5


class _WithUnusedHead(nn.Module):
    """An MLP and a second head its forward pass never calls (a leftover, a head for another task)."""

    def __init__(self):
        super().__init__()
        self.body, self.unused_head = _mlp(), nn.Linear(6, 2)

    def forward(self, x):
        return self.body(x)


def _unused_parameter(find_unused):
    multi = _learner(_WithUnusedHead, bs=8)
    try:
        with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx(find_unused_parameters=find_unused):
            multi.fit(1)
    except RuntimeError as exc:
        return str(exc)
    single = _learner(_WithUnusedHead, bs=8 * dist.get_world_size())
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(1)
    a, b = _weights(single), _weights(multi)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_parameter_without_a_gradient_is_named_at_the_first_step_with_the_fix(pool2):
    """DDP's all-reduce never finishes for a step where a parameter got no gradient: each rank would
    step on its own gradient (silently, at a fit's last step), then the next forward pass fails with
    DDP's advice. Named at the first step instead, on every rank; with the fix, one process's weights."""
    for said in pool2.run(_unused_parameter, False):
        assert said.startswith(
            "distrib_ctx: parameters unused_head.weight, unused_head.bias got no gradient"
        ), said
        assert "find_unused_parameters=True" in said and "\n" not in said
    assert max(pool2.run(_unused_parameter, True)) < 1e-5


def _exact_eval():
    auc = AccumMetric(roc_auc, activation=lambda p: p.softmax(-1)[:, 1], name="auc")
    single = _learner(_mlp, bs=16, metrics=[accuracy, auc])
    expected = single.validate()
    preds_1, targets_1 = single.get_preds()
    multi = _learner(_mlp, bs=16, metrics=[accuracy, auc])
    with multi.distrib_ctx():
        got = multi.validate()
        preds_w, targets_w = multi.get_preds()
        n_local = multi.dl.n_items
    _, valid = _data()
    return {
        "diff": max(abs(a - b) for a, b in zip(expected, got, strict=True)),
        "preds_diff": float((preds_1 - preds_w).abs().max()),
        "targets_in_order": bool(torch.equal(targets_w, valid.tensors[1])),
        "n": len(preds_w),
        "padded": n_local * dist.get_world_size() > 101,
        "auc": got[2],
    }


def test_exact_validation_2_ranks(pool2):
    for r in pool2.run(_exact_eval):
        assert r["padded"] and r["n"] == 101 and r["targets_in_order"]
        assert r["diff"] < 1e-6 and r["preds_diff"] < 1e-6 and 0 < r["auc"] <= 1


def test_exact_validation_3_ranks(pool3):
    results = pool3.run(_exact_eval)
    for r in results:
        assert r["padded"] and r["n"] == 101 and r["targets_in_order"]
        assert r["diff"] < 1e-6 and r["preds_diff"] < 1e-6
    assert len({r["auc"] for r in results}) == 1


def _ragged_preds():
    """Ranks produce outputs of different widths past dim 0: gathered in order, zero padded."""

    class Ragged(nn.Module):
        def forward(self, x):
            width = 2 + dist.get_rank()
            return x[:, :1].repeat(1, width)

    set_seed(0)
    valid = TensorDataset(torch.arange(11.0).unsqueeze(1), torch.arange(11))
    dls = DataLoaders(DataLoader(valid, batch_size=4), DataLoader(valid, batch_size=4))
    learn = Learner(dls, Ragged(), lambda p, y: p.sum() * 0, default_cbs=False)
    with learn.distrib_ctx():
        preds, targets = learn.get_preds()
    return preds.shape, preds[:, 0].tolist(), targets.tolist()


def test_get_preds_with_ragged_outputs(pool2):
    for shape, first_col, targets in pool2.run(_ragged_preds):
        assert tuple(shape) == (11, 3)
        assert first_col == [float(i) for i in range(11)] and targets == list(range(11))


def _early_stopping_and_lr_find():
    learn = _learner(_mlp, bs=8, cbs=[EarlyStopping(monitor="valid_loss", min_delta=10.0, patience=1)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), learn.distrib_ctx():
        learn.fit(10)
        epochs = len(learn.recorder.values)
        before = _weights(learn)
        lr = learn.lr_find(num_it=20)
        after = _weights(learn)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return epochs, lr, unchanged, out.getvalue()


def test_early_stopping_and_lr_find_finish_on_all_ranks(pool2):
    results = pool2.run(_early_stopping_and_lr_find, timeout=60)
    (e0, lr0, same0, out0), (e1, lr1, same1, out1) = results
    assert e0 == e1 == 2  # the first epoch sets the best, the second cannot beat it by 10
    assert lr0 == lr1 > 0 and same0 and same1
    assert "train_loss" in out0 and out1 == ""  # one voice: the table comes from rank 0 only


def _save_load(path):
    learn = _learner(_mlp, bs=8)
    learn.path = path
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        learn.fit(1)
        file = learn.save("ddp")
        learn.load("ddp")
        mtime = os.stat(file).st_mtime_ns
    return str(file), mtime, _weights(learn)["0.weight"]


def test_save_from_rank0_loads_everywhere(pool2, tmp_path):
    (f0, m0, w0), (f1, m1, w1) = pool2.run(_save_load, tmp_path)
    assert f0 == f1 and m0 == m1 and torch.equal(w0, w1)
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["ddp.pth"]  # no temp files left


def _rank0_first_order(path):
    marker = path / "made_by_rank0"

    def make():
        if dist.get_rank() == 0:
            marker.write_text("ok")
        return marker.read_text()  # other ranks read what rank 0 made

    return rank0_first(make)


def test_rank0_first_runs_rank0_before_the_others(pool2, tmp_path):
    assert pool2.run(_rank0_first_order, tmp_path) == ["ok", "ok"]


def _rank0_fails():
    def download():
        if dist.get_rank() == 0:
            raise OSError("disk full")
        return "should not run"

    try:
        rank0_first(download)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_rank0_first_failure_reaches_every_rank(pool2):
    r0, r1 = pool2.run(_rank0_fails, timeout=30)
    assert r0 == "OSError: disk full"
    assert r1.startswith("RuntimeError: rank0_first:") and "disk full" in r1 and "failed on rank 0" in r1


def _different_data():
    set_seed(0)
    n = 32 + 8 * dist.get_rank()
    ds = TensorDataset(torch.randn(n, 6), torch.zeros(n, dtype=torch.long))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=8)), _mlp(), nn.CrossEntropyLoss())
    try:
        with learn.distrib_ctx():
            pass
    except ValueError as exc:
        return str(exc), type(learn.model).__name__
    return "no error", ""


def test_dataset_size_differs_across_ranks_is_refused(pool2):
    for message, model_type in pool2.run(_different_data):
        assert "train dataset differs across ranks" in message and "[32, 40]" in message
        assert model_type == "Sequential"  # nothing left wrapped


class _Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.resets = 0

    def forward(self, x):
        return self.lin(x)

    def reset(self):
        self.resets += 1


def _reset_forwards():
    learn = _learner(_Stateful, bs=8)
    with learn.distrib_ctx():
        learn.model.reset()
    return learn.model.resets


def test_ddp_reset_reaches_the_model(pool2):
    assert pool2.run(_reset_forwards) == [1, 1]


def _own_group_twice():
    """No group exists: distrib_ctx makes one from the launcher variables, and removes it after."""
    states = []
    for _ in range(2):
        learn = _learner(_bn_model, bs=8)
        with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
            states.append((dist.is_initialized(), dist.get_world_size()))
            learn.fit(1)
        states.append((dist.is_initialized(), type(learn.model[1]).__name__))
    return states


def test_distrib_ctx_makes_and_removes_its_own_group(bare_pool2):
    for states in bare_pool2.run(_own_group_twice, timeout=60):
        assert states == [(True, 2), (False, "BatchNorm1d")] * 2


def _world_size_one_is_plain():
    learn = _learner(_mlp, bs=8)
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        kind = type(learn.model).__name__
        learn.fit(1)
    return kind, dist.is_initialized()


def test_outside_a_launch_distrib_ctx_is_a_plain_run():
    env = {
        k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in os.environ
    }
    try:
        assert _world_size_one_is_plain() == ("Sequential", False)
    finally:
        os.environ.update(env)


class _SleepInStep(Callback):
    """Rank 1 stalls inside a training step (user code stuck) at its third batch."""

    def before_backward(self):
        if dist.get_rank() == 1 and self.learn.iter == 2:
            # Stuck past the group timeout (8 s) until rank 0 has named it (or 60 s): no fixed sleep.
            deadline = time.monotonic() + 60
            while not _named_flag().exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            _named_flag().unlink(missing_ok=True)


def _named_flag():
    """A file rank 0 writes once it has raised (one per process group: its port)."""
    return Path(tempfile.gettempdir()) / f"unison-stalled-named-{os.environ['MASTER_PORT']}"


def _stalled_rank():
    learn = _learner(_mlp, bs=8, cbs=[_SleepInStep()])
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx(timeout=8):
            learn.fit(1)
    except Exception as exc:
        elapsed = time.monotonic() - start
        if os.environ.get("RANK") == "0":
            _named_flag().touch()  # rank 1 may wake now
        return type(exc).__name__, str(exc), getattr(exc, "rank", None), elapsed
    return "no error", "", None, time.monotonic() - start


def test_a_stalled_rank_is_named_within_the_timeout(bare_pool2):
    (kind, message, rank, elapsed), _ = bare_pool2.run(_stalled_rank, timeout=60)
    assert kind == "RankStalledError" and rank == 1, message
    assert "rank 1 stopped taking part" in message and "training batch 2" in message
    # The group's timeout (8 s: a healthy first collective can take seconds on a loaded machine),
    # plus the diagnosis and start-up: bounded loosely.
    assert elapsed < 8 + 15


def _ddp_knobs():
    learn = _learner(_mlp, bs=8)
    with learn.distrib_ctx(gradient_as_bucket_view=True, bucket_cap_mb=1):
        return learn.model.gradient_as_bucket_view, learn.model.bucket_bytes_cap


def test_ddp_kwargs_reach_ddp(pool2):
    assert pool2.run(_ddp_knobs) == [(True, 1024 * 1024)] * 2


# ---- AdamW parity, and where float noise grows (README: "What is exact") -------------------------------
class _ReverseBatch(Callback):
    """Reverse the rows of every batch: the same math for one process, summed in another order."""

    def before_batch(self):
        rows = torch.arange(self.learn.xb[0].shape[0] - 1, -1, -1)
        self.learn.xb = tuple(x[rows] for x in self.learn.xb)
        self.learn.yb = tuple(y[rows] for y in self.learn.yb)


def _bn_model_no_bias():
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _adamw_learner(model_fn, bs, cbs=()):
    set_seed(0)
    train, valid = _data()
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=16))
    return Learner(dls, model_fn(), nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, lr=1e-2, cbs=cbs)


def _adamw_parity(model_name):
    model_fn = {"mlp": _mlp, "bn": _bn_model, "bn_no_bias": _bn_model_no_bias}[model_name]
    world = dist.get_world_size()
    single = _adamw_learner(model_fn, 8 * world)
    reordered = _adamw_learner(model_fn, 8 * world, [_ReverseBatch()])
    multi = _adamw_learner(model_fn, 8)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
        reordered.fit(2)
        with multi.distrib_ctx():
            multi.fit(2)
    a, b, r = _weights(single), _weights(multi), _weights(reordered)
    diff = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}
    reorder_diff = {k: float((a[k].float() - r[k].float()).abs().max()) for k in a}
    x = _data()[1].tensors[0]
    with torch.no_grad():  # the function the model computes on a batch (BatchNorm on batch statistics)
        outputs = float((single.model.train()(x) - multi.model.train()(x)).abs().max())
    return diff, reorder_diff, outputs


def test_parity_adamw_mlp(pool2):
    for diff, _, outputs in pool2.run(_adamw_parity, "mlp"):
        assert max(diff.values()) < 1e-6 and outputs < 1e-6


def test_parity_adamw_batchnorm_without_bias_before_it(pool2):
    for diff, _, outputs in pool2.run(_adamw_parity, "bn_no_bias"):
        assert max(diff.values()) < 1e-6 and outputs < 1e-6


def test_adamw_turns_float_noise_into_steps_for_a_bias_before_batchnorm(pool2):
    """A Linear bias right before BatchNorm has a true gradient of zero; its computed gradient is
    rounding noise, which Adam normalises into full-size steps. Its value (and BatchNorm's running
    mean, which tracks it) then differs between 2 processes and 1 by about lr * steps, exactly as
    it differs between 1 process and 1 process summing its batch in another order. Every other
    parameter, and what the model computes, still agree to float precision."""
    for diff, reorder_diff, outputs in pool2.run(_adamw_parity, "bn"):
        noisy = ("0.bias", "1.running_mean")
        assert max(v for k, v in diff.items() if k not in noisy) < 1e-6
        assert outputs < 1e-5  # BatchNorm cancels the bias: the same function
        assert diff["0.bias"] > 1e-4 and reorder_diff["0.bias"] > 1e-4  # noise became steps...
        assert diff["0.bias"] < 10 * reorder_diff["0.bias"]  # ...no more than reordering one batch does


def _frozen_then_unfrozen():
    """A first layer frozen when DDP wraps the model, unfrozen between fits (a hand-written fine-tune)."""
    world = dist.get_world_size()

    def fine_tune(learn, ctx):
        learn.model[0].requires_grad_(False)
        with contextlib.redirect_stdout(io.StringIO()), ctx():
            learn.fit(1)
            learn.raw_model[0].requires_grad_(True)
            learn.fit(1)

    single = _learner(_mlp, bs=8 * world)
    fine_tune(single, contextlib.nullcontext)
    multi = _learner(_mlp, bs=8)
    fine_tune(multi, multi.distrib_ctx)
    a, b = _weights(single), _weights(multi)
    gathered = [None] * world
    dist.all_gather_object(gathered, b)
    ranks_apart = max(float((gathered[0][k] - g[k]).abs().max()) for g in gathered for k in b)
    return max(float((a[k] - b[k]).abs().max()) for k in a), ranks_apart


def test_a_layer_unfrozen_inside_distrib_ctx_trains_as_on_one_process(pool2):
    # DDP synchronises the gradients of the parameters that trained when it wrapped the model: the
    # layer unfrozen later would train on each rank's own gradient unless the model is wrapped again.
    for from_one, ranks_apart in pool2.run(_frozen_then_unfrozen):
        assert ranks_apart == 0.0
        assert from_one < 1e-5

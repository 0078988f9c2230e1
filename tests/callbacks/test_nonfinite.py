"""A non-finite loss or gradient on any rank stops every rank at the same step (issue 19, item 2).

One rank's batch is made NaN at step 5. Every rank must raise `NonFiniteError` at that step,
naming the epoch, the step and the rank whose batch produced it; the weights stay the last
good ones (an independent plain loop over the first 5 global batches gives them) and the
`Checkpoint` file written before the NaN keeps its bytes. `on_nonfinite="skip"` must equal a
plain loop that leaves that step out. Real processes on real gloo groups throughout.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.hangs import run_or_report
from unison import Callback, Checkpoint, DataLoaders, Learner, SaveModelCallback, set_seed

N_TRAIN, N_VALID, DIM = 64, 16, 5
GLOBAL_BS = 8  # 8 global steps per epoch
LR = 0.05
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fault_scripts" / "nonfinite.py"


# ---- the pieces: data, models, the poisoned batch, an independent plain loop ----------------
def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N_TRAIN + N_VALID, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(N_TRAIN + N_VALID, 1, generator=g)
    return x, y


def _linear():
    return nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1))


def _with_bn():
    return nn.Sequential(nn.Linear(DIM, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class SqrtDistance(nn.Module):
    """pred = a * |x - c| + b: a row equal to `c` has a finite loss and a NaN gradient (sqrt at 0)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.randn(DIM))
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(((x - self.c) ** 2).sum(1, keepdim=True).sqrt())


MODELS = {"linear": _linear, "bn": _with_bn, "sqrt": SqrtDistance}


def _model(kind):
    set_seed(0)
    return MODELS[kind]()


class Poison(Callback):
    """Makes the batch of `rank` at (`epoch`, `step`) bad: a NaN input (`nan`, `inf`), or a row
    placed on the model's kink (`kink`: finite loss, NaN gradient). `phase`: train or valid."""

    order = -100  # before anything reads the batch

    def __init__(self, step=5, rank=1, epoch=0, kind="nan", phase="train", every_epoch=False):
        self.step, self.rank, self.epoch, self.kind = step, rank, epoch, kind
        self.phase, self.every_epoch = phase, every_epoch

    def before_batch(self):
        learn = self.learn
        if learn.training != (self.phase == "train") or learn.iter != self.step:
            return
        if learn.collective.rank != self.rank or (learn.epoch != self.epoch and not self.every_epoch):
            return
        x = learn.xb[0].clone()
        if self.kind == "kink":
            x[0] = learn.raw_model.c.detach()
        else:
            x[0, 0] = float(self.kind)
        learn.xb = (x, *learn.xb[1:])


def _checkpoint_bytes(learn):
    """The checkpoint's bytes: its file, or every file of a sharded run's `.dcp` folder."""
    file = learn.get_cb(Checkpoint).file
    folder = file.with_suffix(".dcp")
    if folder.is_dir():
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return file.read_bytes()


class KeepBytes(Callback):
    """The checkpoint's bytes right after the save of training batch `step` (rank 0)."""

    order = 95  # after Checkpoint (90) wrote

    def __init__(self, step=4):
        self.step, self.data = step, None

    def after_batch(self):
        learn = self.learn
        if learn.training and learn.epoch == 0 and learn.iter == self.step and learn.collective.is_main:
            self.data = _checkpoint_bytes(learn)


def _learner(path, bs, kind="linear", cbs=(), opt=torch.optim.SGD, lr=LR, loss_func=None, **kwargs):
    x, y = _data()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=bs),
        DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=4),
    )
    loss_func = loss_func or nn.MSELoss()
    learn = Learner(dls, _model(kind), loss_func, opt_func=opt, lr=lr, path=path, cbs=list(cbs), **kwargs)
    learn.recorder.print_table = False
    return learn


def _plain(kind="linear", steps=None, skip=(), epochs=1, opt=torch.optim.SGD, scaler=None, lr=LR, scale=1.0):
    """One process, batch GLOBAL_BS, in order; global steps in `skip` ((epoch, step)) left out."""
    x, y = _data()
    model = _model(kind)
    optimizer = opt(model.parameters(), lr=lr)
    done = 0
    for epoch in range(epochs):
        for k in range(N_TRAIN // GLOBAL_BS):
            if steps is not None and done == steps:
                return model
            done += 1
            if (epoch, k) in skip:
                continue
            model.train()
            xb, yb = x[k * GLOBAL_BS : (k + 1) * GLOBAL_BS], y[k * GLOBAL_BS : (k + 1) * GLOBAL_BS]
            loss = F.mse_loss(model(xb), yb) * scale
            optimizer.zero_grad()
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
    return model


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a, b, atol=1e-6):
    return set(a) == set(b) and all(torch.allclose(a[k].double(), b[k].double(), atol=atol) for k in a)


def _finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def _outcome(exc):
    """What a worker reports of the error it got (or None)."""
    if exc is None:
        return None
    return {
        "type": type(exc).__name__,
        "epoch": getattr(exc, "epoch", None),
        "step": getattr(exc, "step", None),
        "ranks": getattr(exc, "ranks", None),
        "what": getattr(exc, "what", None),
        "message": str(exc),
    }


def _fit(learn, epochs=2, distributed=False, shard=False):
    """Fit quietly; the error it raised (or None)."""
    ctx = learn.distrib_ctx(shard=shard) if distributed else contextlib.nullcontext()
    try:
        with ctx, contextlib.redirect_stdout(io.StringIO()):
            learn.fit(epochs)
    except Exception as exc:
        return exc
    return None


# ---- one process ------------------------------------------------------------------------------
def test_one_process_nan_batch_stops_at_that_step_and_keeps_the_checkpoint(tmp_path):
    keep = KeepBytes(step=4)
    learn = _learner(tmp_path, GLOBAL_BS, cbs=[Poison(step=5, rank=0), Checkpoint(every=1), keep])
    got = _outcome(_fit(learn))
    assert got is not None, f"fit ended without an error; weights finite: {_finite(_state(learn.model))}"
    assert (got["type"], got["epoch"], got["step"], got["ranks"], got["what"]) == (
        "NonFiniteError",
        0,
        5,
        (0,),
        "loss",
    )
    assert "epoch 0" in got["message"] and "step 5" in got["message"] and "rank 0" in got["message"]
    assert "\n" not in got["message"]
    expected = _state(_plain(steps=5))  # the 5 good steps, and not the 6th
    assert _close(_state(learn.model), expected)
    file = learn.get_cb(Checkpoint).file
    assert file.read_bytes() == keep.data  # written after step 4, never again
    assert _close(torch.load(file, weights_only=True)["model"], expected)


def test_one_process_skip_equals_a_plain_loop_without_that_step(tmp_path):
    """BatchNorm too: the skipped batch's forward pass must not leave its statistics behind."""
    learn = _learner(tmp_path, GLOBAL_BS, kind="bn", cbs=[Poison(step=5, rank=0)], on_nonfinite="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fit(learn, epochs=2) is None
    expected = _state(_plain("bn", skip={(0, 5)}, epochs=2))
    assert _close(_state(learn.model), expected)
    assert not _close(_state(learn.model), _state(_plain("bn", skip={(0, 4)}, epochs=2)))  # the test can tell
    check = learn.get_cb(_check_class())
    assert check.skipped == [(0, 5, (0,))]
    assert all(math.isfinite(v) for v in learn.recorder.values[0])  # the skipped batch is not recorded
    assert any("skipped" in str(w.message) and "step 5" in str(w.message) for w in caught)


def test_skip_with_accumulation_leaves_the_whole_step_out_of_the_recorded_losses(tmp_path):
    """A NaN on a step's first micro-batch: the step is skipped, and neither micro-batch's loss is
    recorded (the first one's NaN was, and made the epoch's train_loss NaN)."""
    from unison import GradientAccumulation

    poison = Poison(step=4, rank=0)  # micro-batches 4 and 5 make global step 2
    learn = _learner(tmp_path, GLOBAL_BS // 2, cbs=[poison, GradientAccumulation(2)], on_nonfinite="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _fit(learn, epochs=1) is None
    assert _close(_state(learn.model), _state(_plain(skip={(0, 2)})))
    losses = learn.recorder.losses
    assert len(losses) == N_TRAIN // (GLOBAL_BS // 2) - 2 and all(map(math.isfinite, losses))
    assert learn.recorder.values[0][0] == pytest.approx(sum(losses) / len(losses))  # equal batches
    assert len(learn.recorder.lrs) == len(losses)


def test_a_nan_gradient_from_a_finite_loss_stops_too(tmp_path):
    learn = _learner(tmp_path, GLOBAL_BS, kind="sqrt", cbs=[Poison(step=3, rank=0, kind="kink")])
    got = _outcome(_fit(learn))
    assert got is not None and (got["type"], got["step"], got["ranks"], got["what"]) == (
        "NonFiniteError",
        3,
        (0,),
        "gradient",
    )
    assert _close(_state(learn.model), _state(_plain("sqrt", steps=3)))


def test_a_huge_but_finite_gradient_is_not_taken_for_a_nan(tmp_path):
    """Gradients near 1e25: their 2-norm overflows float32 (the fast check), every element is finite."""
    scale, lr = 1e25, 1e-27
    learn = _learner(tmp_path, GLOBAL_BS, lr=lr, loss_func=lambda pred, y: F.mse_loss(pred, y) * scale)
    assert _fit(learn, epochs=1) is None
    assert _close(_state(learn.model), _state(_plain(lr=lr, scale=scale)))
    grads = [p.grad for p in _plain(lr=lr, scale=scale, steps=1).parameters()]
    assert not torch.isfinite(torch.nn.utils.get_total_norm(grads, 2.0))  # the fast check did overflow


def test_anomaly_names_the_backward_op(tmp_path):
    learn = _learner(
        tmp_path, GLOBAL_BS, kind="sqrt", cbs=[Poison(step=3, rank=0, kind="kink")], on_nonfinite="anomaly"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's anomaly mode warns the forward traceback
        got = _outcome(_fit(learn))
    assert got is not None and got["type"] == "NonFiniteError" and got["ranks"] == (0,)
    assert "PowBackward0" in got["message"]
    assert not torch.is_anomaly_enabled()


def test_a_nonfinite_validation_loss_stops_before_the_epoch_is_saved(tmp_path):
    ckpt = Checkpoint()  # at each epoch's end
    learn = _learner(tmp_path, GLOBAL_BS, cbs=[Poison(step=1, rank=0, epoch=1, phase="valid"), ckpt])
    got = _outcome(_fit(learn, epochs=3))
    assert got is not None and (got["type"], got["epoch"], got["ranks"], got["what"]) == (
        "NonFiniteError",
        1,
        (0,),
        "validation loss",
    )
    saved = torch.load(ckpt.file, weights_only=True)
    assert saved["epoch"] == 1  # epoch 0's checkpoint, not epoch 1's
    assert _close(saved["model"], _state(_plain(steps=8)))


def test_skip_reports_a_nonfinite_validation_loss_and_never_takes_it_as_best(tmp_path):
    best = SaveModelCallback(fname="best", load_best=False)
    cbs = [Poison(step=1, rank=0, epoch=1, phase="valid"), best]
    learn = _learner(tmp_path, GLOBAL_BS, cbs=cbs, on_nonfinite="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fit(learn, epochs=3) is None
    valid = [row[1] for row in learn.recorder.values]
    assert math.isnan(valid[1]) and math.isfinite(valid[0]) and math.isfinite(valid[2])
    # The plain loop's validation losses, computed here: the best is the smaller finite one.
    x, y = _data()
    losses = [F.mse_loss(_plain(epochs=e).eval()(x[N_TRAIN:]), y[N_TRAIN:]).item() for e in (1, 3)]
    assert best.best == pytest.approx(min(losses), rel=1e-5)
    assert any("validation" in str(w.message) and "epoch 1" in str(w.message) for w in caught)


class CPUScaler(Callback):
    """What MixedPrecision("fp16") does with its scaler (unscale in before_step at order -5), on CPU."""

    order = -5

    def __init__(self, init_scale):
        self.init_scale = init_scale

    def before_fit(self):
        self.learn.scaler = torch.amp.GradScaler("cpu", init_scale=self.init_scale)

    def before_step(self):
        self.learn.scaler.unscale_(self.learn.opt)


def test_a_grad_scaler_keeps_skipping_its_overflow_steps(tmp_path):
    """A scale so large that the first steps overflow: the scaler skips them, as before; a NaN
    loss still stops."""
    scale = 2.0**127
    learn = _learner(tmp_path, GLOBAL_BS, cbs=[CPUScaler(scale)])
    assert _fit(learn, epochs=1) is None
    expected = _plain(scaler=torch.amp.GradScaler("cpu", init_scale=scale))
    assert _close(_state(learn.model), _state(expected))
    assert learn.scaler.get_scale() < scale  # it did overflow and back off
    learn = _learner(tmp_path, GLOBAL_BS, cbs=[CPUScaler(2.0**8), Poison(step=5, rank=0)])
    got = _outcome(_fit(learn, epochs=1))
    assert got is not None and (got["type"], got["step"], got["ranks"]) == ("NonFiniteError", 5, (0,))


def test_lr_find_is_left_to_its_own_divergence_check(tmp_path):
    found = []
    for mode in ("stop", None):
        learn = _learner(tmp_path, GLOBAL_BS, on_nonfinite=mode)
        with contextlib.redirect_stdout(io.StringIO()):
            found.append((learn.lr_find(end_lr=1e6, num_it=40, stop_div=False), learn.lr_finder.losses))
    assert not all(math.isfinite(v) for v in found[0][1])  # the sweep did reach non-finite losses
    assert found[0][0] == found[1][0]
    assert [repr(v) for v in found[0][1]] == [repr(v) for v in found[1][1]]


def test_the_error_is_one_line_and_survives_pickling():
    from unison.callbacks.nonfinite import NonFiniteError

    err = NonFiniteError("loss", epoch=2, step=7, ranks=(1, 3), value=float("nan"))
    back = pickle.loads(pickle.dumps(err))
    assert (back.what, back.epoch, back.step, back.ranks) == ("loss", 2, 7, (1, 3))
    assert str(back) == str(err) and "\n" not in str(err)
    assert "epoch 2" in str(err) and "step 7" in str(err) and "ranks 1, 3" in str(err)
    with pytest.raises(ValueError, match="on_nonfinite"):
        _learner(".", GLOBAL_BS, on_nonfinite="ignore")


def _check_class():
    from unison.callbacks.nonfinite import NonFiniteCheck

    return NonFiniteCheck


# ---- two processes (real gloo group) ----------------------------------------------------------
def _stop_two(path, kind="linear", poison="nan", shard=False, mode=None):
    keep = KeepBytes(step=4)
    step = 5 if kind == "linear" else 3
    cbs = [Poison(step=step, rank=1, kind=poison), Checkpoint(every=1), keep]
    kwargs = {} if mode is None else {"on_nonfinite": mode}
    learn = _learner(path, GLOBAL_BS // 2, kind=kind, cbs=cbs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _outcome(_fit(learn, distributed=True, shard=shard))
    same_file = keep.data == _checkpoint_bytes(learn) if keep.data is not None else None
    return got, _state(learn.raw_model), same_file


@pytest.mark.slow
def test_two_processes_nan_on_rank_1_stops_both_at_step_5_naming_rank_1(pool2, tmp_path):
    (got0, w0, same_file), (got1, w1, _) = pool2.run(_stop_two, str(tmp_path))
    assert got0 is not None and got1 is not None, f"fit ended without an error; weights finite: {_finite(w0)}"
    for got in (got0, got1):
        assert (got["type"], got["epoch"], got["step"], got["ranks"], got["what"]) == (
            "NonFiniteError",
            0,
            5,
            (1,),
            "loss",
        )
        assert "rank 1" in got["message"] and "step 5" in got["message"]
    assert got0["message"] == got1["message"]
    expected = _state(_plain(steps=5))
    assert _close(w0, expected) and _close(w1, expected)
    assert same_file is True  # the checkpoint of step 4 kept its bytes
    saved = torch.load(tmp_path / "models" / "checkpoint.pth", weights_only=True)
    assert _close(saved["model"], expected)


@pytest.mark.slow
def test_two_processes_a_nan_gradient_is_traced_to_its_rank_and_op(pool2, tmp_path):
    for mode in ("stop", "anomaly"):
        (got0, w0, _), (got1, w1, _) = pool2.run(_stop_two, str(tmp_path / mode), "sqrt", "kink", False, mode)
        assert got0 == got1 and got0 is not None, (got0, got1)
        assert (got0["type"], got0["step"], got0["ranks"], got0["what"]) == (
            "NonFiniteError",
            3,
            (1,),
            "gradient",
        )
        if mode == "anomaly":
            assert "PowBackward0" in got0["message"]
        expected = _state(_plain("sqrt", steps=3))
        assert _close(w0, expected) and _close(w1, expected)


@pytest.mark.slow
def test_two_sharded_processes_nan_on_rank_1_stops_both_naming_rank_1(pool2, tmp_path):
    (got0, w0, same_file), (got1, w1, _) = pool2.run(_stop_two, str(tmp_path), "linear", "nan", True)
    assert got0 is not None and got0 == got1, (got0, got1)
    assert (got0["type"], got0["epoch"], got0["step"], got0["ranks"]) == ("NonFiniteError", 0, 5, (1,))
    expected = _state(_plain(steps=5))
    assert _close(w0, expected, atol=1e-5) and _close(w1, expected, atol=1e-5)
    assert same_file is True  # every shard file of step 4's checkpoint kept its bytes


def _skip_two(path):
    learn = _learner(path, GLOBAL_BS // 2, cbs=[Poison(step=5, rank=1)], on_nonfinite="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _outcome(_fit(learn, epochs=2, distributed=True))
    check = learn.get_cb(_check_class())
    return got, _state(learn.raw_model), check.skipped, learn.recorder.values


@pytest.mark.slow
def test_two_processes_skip_equals_a_plain_loop_without_that_step(pool2, tmp_path):
    (got0, w0, skipped0, values0), (got1, w1, skipped1, _) = pool2.run(_skip_two, str(tmp_path))
    assert got0 is None and got1 is None, (got0, got1)
    expected = _state(_plain(skip={(0, 5)}, epochs=2))
    assert _close(w0, expected) and _close(w1, expected)
    assert skipped0 == skipped1 == [(0, 5, (1,))]
    assert all(math.isfinite(v) for row in values0 for v in row)


def _skip_accumulated_two(path):
    from unison import GradientAccumulation

    cbs = [Poison(step=2, rank=1), GradientAccumulation(2)]  # micro-batches 2 and 3: global step 1
    learn = _learner(path, GLOBAL_BS // 4, cbs=cbs, on_nonfinite="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _outcome(_fit(learn, epochs=1, distributed=True))
    return got, _state(learn.raw_model), learn.recorder.losses, learn.recorder.values


@pytest.mark.slow
def test_two_processes_skip_with_accumulation_records_neither_micro_batch(pool2, tmp_path):
    """Every rank leaves the same micro-batches out of its record (the losses are reduced batch by batch)."""
    (got0, w0, losses0, values0), (got1, w1, losses1, _) = pool2.run(_skip_accumulated_two, str(tmp_path))
    assert got0 is None and got1 is None, (got0, got1)
    expected = _state(_plain(skip={(0, 1)}))
    assert _close(w0, expected) and _close(w1, expected)
    assert losses0 == losses1 and len(losses0) == 2 * N_TRAIN // GLOBAL_BS - 2
    assert all(math.isfinite(v) for v in [*losses0, *values0[0]])


def _valid_two(path):
    learn = _learner(path, GLOBAL_BS // 2, cbs=[Poison(step=1, rank=1, epoch=0, phase="valid")])
    return _outcome(_fit(learn, epochs=2, distributed=True))


@pytest.mark.slow
def test_two_processes_nan_validation_on_rank_1_stops_both_naming_it(pool2, tmp_path):
    got0, got1 = pool2.run(_valid_two, str(tmp_path))
    assert got0 is not None and got0 == got1, (got0, got1)
    assert (got0["type"], got0["epoch"], got0["ranks"], got0["what"]) == (
        "NonFiniteError",
        0,
        (1,),
        "validation loss",
    )


# ---- under unison launch --max-restarts 2 ----------------------------------------------------
@pytest.mark.launch
def test_launch_stops_on_a_nan_and_does_not_restart_into_it(tmp_path):
    logs, work = tmp_path / "logs", tmp_path / "work"
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--max-restarts", "2"]
    cmd += ["--log-dir", str(logs), str(SCRIPT), "--dir", str(work), "--nan-rank", "1", "--at", "5"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = run_or_report(cmd, 180, env=env)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "not restarting: rank" in proc.stderr and "NonFiniteError" in proc.stderr, proc.stderr[-3000:]
    assert "epoch 0, step 5" in proc.stderr and "rank 1" in proc.stderr
    assert "restarting the workers" not in proc.stderr
    assert sorted(p.name for p in logs.iterdir() if p.name.startswith("attempt_")) == ["attempt_0"]
    assert (work / "models" / "checkpoint.pth").read_bytes() == (work / "step4.pth").read_bytes()
    saved = torch.load(work / "models" / "checkpoint.pth", weights_only=True)
    assert _close(saved["model"], _state(_plain(steps=5)))

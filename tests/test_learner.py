"""The Learner on one process: event order, cancellation, evaluation, checkpoints, schedules, bad input."""

import copy
import math
import pickle
import re
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from unison import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelEpochException,
    CancelFitException,
    CancelTrainException,
    CancelValidException,
    CheckpointError,
    DataLoaders,
    Learner,
    Recorder,
    accuracy,
    set_seed,
)
from unison.checkpoint.format import FORMAT_KEY, FORMAT_VERSION

# ---- helpers ------------------------------------------------------------------------------


def make_data(n, n_in=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def make_dls(n_train=16, n_valid=8, bs=8, valid_bs=None, shuffle=False):
    xt, yt = make_data(n_train, seed=1)
    xv, yv = make_data(n_valid, seed=2)
    return DataLoaders(
        DataLoader(TensorDataset(xt, yt), batch_size=bs, shuffle=shuffle),
        DataLoader(TensorDataset(xv, yv), batch_size=valid_bs or bs),
    )


def make_learner(tmp_path=None, dls=None, model=None, **kwargs):
    torch.manual_seed(0)
    kwargs.setdefault("path", tmp_path if tmp_path is not None else ".")
    return Learner(dls or make_dls(), model or nn.Linear(4, 2), nn.CrossEntropyLoss(), **kwargs)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def opt_state_equal(s1, s2):
    """Optimizer state dicts equal, tensors compared exactly."""
    if s1["param_groups"] != s2["param_groups"] or s1["state"].keys() != s2["state"].keys():
        return False
    for k in s1["state"]:
        a, b = s1["state"][k], s2["state"][k]
        if a.keys() != b.keys():
            return False
        for name in a:
            if isinstance(a[name], torch.Tensor):
                if not torch.equal(a[name], b[name]):
                    return False
            elif a[name] != b[name]:
                return False
    return True


class EventLog(Callback):
    """Logs every event of `EVENTS` it receives (low order: it sees each event first)."""

    order = -100

    def __init__(self):
        self.events = []


for _event in EVENTS:
    setattr(EventLog, _event, (lambda e: lambda self: self.events.append(e))(_event))


class RaiseAt(Callback):
    """Raises `exc` at `event` when `when(learn)` is true."""

    def __init__(self, event, exc, when=lambda learn: True):
        self.exc, self.when = exc, when
        setattr(self, event, self._maybe_raise)

    def _maybe_raise(self):
        if self.when(self.learn):
            raise self.exc()


TRAIN_BATCH = [
    "before_batch",
    "after_pred",
    "after_loss",
    "before_backward",
    "after_backward",
    "before_step",
    "after_step",
    "after_batch",
]
VALID_BATCH = ["before_batch", "after_pred", "after_loss", "after_batch"]


def epoch_events(n_train=2, n_valid=1):
    return [
        "before_epoch",
        "before_train",
        *TRAIN_BATCH * n_train,
        "after_train",
        "before_validate",
        *VALID_BATCH * n_valid,
        "after_validate",
        "after_epoch",
    ]


# ---- events and callbacks --------------------------------------------------------------------


def test_event_order_of_a_two_epoch_fit():
    log = EventLog()
    learn = make_learner(dls=make_dls(n_train=16, n_valid=8, bs=8), cbs=[log])
    learn.fit(2)
    assert log.events == ["before_fit", *epoch_events(), *epoch_events(), "after_fit"]


def test_callback_order_is_respected():
    calls = []

    class Named(Callback):
        def __init__(self, name, order):
            self.cb_name, self.order = name, order

        def before_fit(self):
            calls.append(self.cb_name)

        def after_epoch(self):
            # Recorder (order 50) has appended this epoch's row only for callbacks after it.
            calls.append((self.cb_name, len(self.learn.recorder.values)))

    learn = make_learner(cbs=[Named("c", 55), Named("a", -5), Named("b", 3), Named("d", 40)])
    learn.fit(1)
    assert calls[:4] == ["a", "b", "d", "c"]
    assert calls[4:] == [("a", 0), ("b", 0), ("d", 0), ("c", 1)]
    orders = [cb.order for cb in learn.cbs]
    assert orders == sorted(orders)


def test_cancel_fit_runs_after_cancel_fit_then_after_fit_only():
    log = EventLog()
    learn = make_learner(cbs=[log, RaiseAt("after_step", CancelFitException)])
    before = weights(learn.model)
    learn.fit(2)
    assert log.events == [
        "before_fit",
        "before_epoch",
        "before_train",
        *TRAIN_BATCH[:-1],
        "after_cancel_fit",
        "after_fit",
    ]
    # The one step that ran before the cancel is kept.
    assert not torch.equal(before["weight"], learn.model.weight)
    assert learn.recorder.values == []


def test_cancel_epoch_skips_the_rest_of_that_epoch_only():
    log = EventLog()
    cancel = RaiseAt("before_train", CancelEpochException, when=lambda learn: learn.epoch == 0)
    learn = make_learner(cbs=[log, cancel])
    learn.fit(2)
    assert log.events == [
        "before_fit",
        "before_epoch",
        "before_train",
        "after_cancel_epoch",
        "after_epoch",
        *epoch_events(),
        "after_fit",
    ]
    assert len(learn.recorder.values) == 2
    assert all(math.isnan(v) for v in learn.recorder.values[0])
    assert all(math.isfinite(v) for v in learn.recorder.values[1])


def test_cancel_train_skips_remaining_batches_but_validates():
    log = EventLog()
    cancel = RaiseAt(
        "before_batch", CancelTrainException, when=lambda learn: learn.training and learn.iter == 1
    )
    learn = make_learner(cbs=[log, cancel])
    learn.fit(1)
    assert log.events == [
        "before_fit",
        "before_epoch",
        "before_train",
        *TRAIN_BATCH,
        "before_batch",
        "after_cancel_train",
        "after_train",
        "before_validate",
        *VALID_BATCH,
        "after_validate",
        "after_epoch",
        "after_fit",
    ]
    assert len(learn.recorder.losses) == 1  # one training batch ran
    assert math.isfinite(learn.recorder.values[0][1])  # validation ran


def test_cancel_valid_skips_validation():
    log = EventLog()
    learn = make_learner(cbs=[log, RaiseAt("before_validate", CancelValidException)], metrics=[accuracy])
    learn.fit(1)
    assert log.events == [
        "before_fit",
        "before_epoch",
        "before_train",
        *TRAIN_BATCH * 2,
        "after_train",
        "before_validate",
        "after_cancel_validate",
        "after_validate",
        "after_epoch",
        "after_fit",
    ]
    train_loss, valid_loss, acc = learn.recorder.values[0]
    assert math.isfinite(train_loss)
    assert math.isnan(valid_loss) and math.isnan(acc)


def test_cancel_batch_in_before_step_skips_the_step():
    log = EventLog()
    learn = make_learner(cbs=[log, RaiseAt("before_step", CancelBatchException)])
    before = weights(learn.model)
    learn.fit(1)
    cancelled = [*TRAIN_BATCH[:6], "after_cancel_batch", "after_batch"]
    assert log.events == [
        "before_fit",
        "before_epoch",
        "before_train",
        *cancelled * 2,
        "after_train",
        "before_validate",
        *VALID_BATCH,
        "after_validate",
        "after_epoch",
        "after_fit",
    ]
    assert_same_weights(before, weights(learn.model))
    assert learn.opt.state == {}  # AdamW never stepped


@pytest.mark.parametrize(
    "event, exc, nan_columns",
    [
        ("before_epoch", CancelEpochException, [0, 1, 2]),
        ("before_train", CancelTrainException, [0]),
        ("before_validate", CancelValidException, [1, 2]),
    ],
)
def test_a_phase_cancelled_before_it_began_is_recorded_as_nan(event, exc, nan_columns):
    # The canceller (order 0) runs before the Recorder (order 50) sees the phase begin: the row of
    # that epoch must not repeat the previous epoch's values.
    learn = make_learner(metrics=[accuracy], cbs=[RaiseAt(event, exc, when=lambda learn: learn.epoch == 1)])
    learn.fit(3)
    rows = learn.recorder.values
    assert len(rows) == 3
    assert all(math.isfinite(v) for v in rows[0] + rows[2])
    assert [i for i, v in enumerate(rows[1]) if math.isnan(v)] == nan_columns
    assert len(learn.recorder.times) == 3 and learn.recorder.times[1] < 60


def _skip_second_train_batch():
    return RaiseAt(
        "before_batch", CancelBatchException, when=lambda learn: learn.training and learn.iter == 1
    )


def test_cancel_batch_in_before_batch_skips_forward():
    log = EventLog()
    learn = make_learner(cbs=[log, _skip_second_train_batch()])
    learn.fit(1)
    assert log.events[3 : 3 + 11] == [*TRAIN_BATCH, "before_batch", "after_cancel_batch", "after_batch"]
    assert log.events.count("after_pred") == 2  # one train batch, one valid batch
    assert log.events.count("after_step") == 1


def test_a_batch_cancelled_before_its_forward_pass_is_not_recorded():
    learn = make_learner(cbs=[_skip_second_train_batch()])
    learn.fit(1)
    assert len(learn.recorder.losses) == 1
    first_batch_loss = learn.recorder.losses[0]
    assert learn.recorder.values[0][0] == pytest.approx(first_batch_loss)


def test_add_cb_and_remove_cb_by_instance_and_by_class():
    learn = make_learner()
    learn.add_cb(EventLog)
    by_class = learn.get_cb(EventLog)
    assert isinstance(by_class, EventLog) and by_class.learn is learn
    learn.remove_cb(EventLog)
    assert learn.get_cb(EventLog) is None

    log = EventLog()
    learn.add_cb(log)
    assert log in learn.cbs and log.learn is learn
    learn.fit(1)
    n_events = len(log.events)
    assert n_events > 0
    learn.remove_cb(log)
    assert log not in learn.cbs
    learn.fit(1)
    assert len(log.events) == n_events  # a removed callback hears nothing
    assert by_class.events == []


def test_fit_cbs_are_only_attached_for_that_fit():
    learn = make_learner()
    log = EventLog()
    learn.fit(1, cbs=[log])
    assert log not in learn.cbs
    assert log.events[0] == "before_fit" and log.events[-1] == "after_fit"


# ---- evaluation ----------------------------------------------------------------------------


def test_validate_is_exact_over_the_whole_set_with_an_uneven_last_batch():
    xv, yv = make_data(37, seed=3)
    xt, yt = make_data(16, seed=4)
    dls = DataLoaders(
        DataLoader(TensorDataset(xt, yt), batch_size=8), DataLoader(TensorDataset(xv, yv), batch_size=8)
    )
    learn = make_learner(dls=dls, model=nn.Linear(4, 2), metrics=[accuracy])
    learn.fit(1, lr=0.1)
    valid_loss, acc = learn.validate()
    with torch.no_grad():
        out = learn.model(xv)
    expected_loss = F.cross_entropy(out, yv, reduction="sum").item() / 37
    expected_acc = (out.argmax(-1) == yv).float().sum().item() / 37
    assert valid_loss == pytest.approx(expected_loss, rel=1e-6)
    assert acc == pytest.approx(expected_acc, abs=1e-7)
    # The mean of per-batch accuracies would differ: the check above is about weighting.
    batch_means = [
        (out[i : i + 8].argmax(-1) == yv[i : i + 8]).float().mean().item() for i in range(0, 37, 8)
    ]
    assert sum(batch_means) / len(batch_means) != pytest.approx(expected_acc, abs=1e-7)


def test_validate_on_another_loader():
    learn = make_learner()
    x, y = make_data(11, seed=9)
    (loss,) = learn.validate(DataLoader(TensorDataset(x, y), batch_size=4))
    with torch.no_grad():
        assert loss == pytest.approx(F.cross_entropy(learn.model(x), y).item(), rel=1e-6)


def test_get_preds_in_loader_order_with_dataset_targets():
    xv, yv = make_data(21, seed=5)
    dls = DataLoaders(make_dls().train, DataLoader(TensorDataset(xv, yv), batch_size=4))
    learn = make_learner(dls=dls)
    learn.fit(1)
    preds, targets = learn.get_preds()
    with torch.no_grad():
        expected = learn.model(xv)
    assert preds.shape == (21, 2)
    assert torch.allclose(preds, expected, atol=1e-6)
    assert torch.equal(targets, yv)


# ---- checkpoints ---------------------------------------------------------------------------


def test_save_load_round_trip_restores_weights_and_optimizer_state(tmp_path):
    learn = make_learner(tmp_path)
    learn.fit(2)
    file = learn.save("stage1")
    assert file == tmp_path / "models" / "stage1.pth" and file.is_file()
    saved_w, saved_opt = weights(learn.model), learn.opt.state_dict()

    other = make_learner(tmp_path, model=nn.Linear(4, 2))
    with torch.no_grad():
        other.model.weight.add_(1.0)
    other.load("stage1")
    assert_same_weights(saved_w, weights(other.model))
    assert other.opt is not None and len(other.opt.state) == 2
    assert opt_state_equal(saved_opt, other.opt.state_dict())


def test_saved_file_has_the_permissions_of_a_plain_file(tmp_path):
    learn = make_learner(tmp_path)
    file = learn.save("perm")
    plain = file.parent / "plain"
    plain.write_bytes(b"x")  # created under the same umask
    assert file.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_truncated_checkpoint_is_refused_and_good_one_still_loads(tmp_path):
    learn = make_learner(tmp_path)
    learn.fit(1)
    good = learn.save("good")
    data = good.read_bytes()
    saved = weights(learn.model)
    with torch.no_grad():
        learn.model.weight.zero_()
    current = weights(learn.model)
    bad = tmp_path / "models" / "bad.pth"
    for cut in sorted({0, 1, 2, 3, 10, 64, len(data) // 3, len(data) // 2, len(data) - 22, len(data) - 1}):
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"damaged or truncated") as info:
            learn.load("bad")
        assert str(bad) in str(info.value), cut
        assert_same_weights(current, weights(learn.model))  # nothing changed by a refused load
    assert good.read_bytes() == data
    learn.load("good")
    assert_same_weights(saved, weights(learn.model))


def test_failed_save_over_an_existing_name_keeps_the_old_file(tmp_path):
    learn = make_learner(tmp_path)
    learn.fit(1)
    file = learn.save("ckpt")
    old_bytes, old_weights = file.read_bytes(), weights(learn.model)
    learn.fit(1)
    assert not torch.equal(old_weights["weight"], learn.model.weight)
    # An optimizer state torch.save cannot pickle: the save fails midway.
    learn.opt.state[learn.model.weight]["hook"] = lambda: None
    with pytest.raises((pickle.PicklingError, AttributeError), match=r"(?i)pickle"):
        learn.save("ckpt")
    assert file.read_bytes() == old_bytes
    assert sorted(p.name for p in file.parent.iterdir()) == ["ckpt.pth"]  # no temporary left behind
    del learn.opt.state[learn.model.weight]["hook"]
    learn.load("ckpt")
    assert_same_weights(old_weights, weights(learn.model))


def test_load_of_a_missing_file_names_the_path(tmp_path):
    learn = make_learner(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "models" / "nothing.pth"))):
        learn.load("nothing")


PICKLE_SIDE_EFFECTS = []


def _record_side_effect(tag):
    PICKLE_SIDE_EFFECTS.append(tag)
    return tag


class Payload:
    """Unpickling this runs `_record_side_effect`: `weights_only` must refuse it first."""

    def __reduce__(self):
        return (_record_side_effect, ("executed",))


def test_file_with_a_pickled_object_is_refused(tmp_path):
    learn = make_learner(tmp_path)
    file = tmp_path / "models" / "evil.pth"
    file.parent.mkdir(parents=True)
    state = {FORMAT_KEY: FORMAT_VERSION, "kind": "model", "model": learn.model.state_dict(), "x": Payload()}
    torch.save(state, file)
    before = weights(learn.model)
    with pytest.raises(CheckpointError, match=r"refused") as info:
        learn.load("evil")
    assert "_record_side_effect" in str(info.value)  # names what it refused
    assert "\x1b" not in str(info.value)  # no terminal escape codes in the message
    assert PICKLE_SIDE_EFFECTS == []
    assert_same_weights(before, weights(learn.model))


def test_load_of_a_checkpoint_for_another_model_is_refused(tmp_path):
    learn = make_learner(tmp_path)
    learn.save("small")
    other = make_learner(tmp_path, model=nn.Linear(4, 3))
    before = weights(other.model)
    with pytest.raises(CheckpointError, match=r"does not fit this model: weight has shape \(2, 4\)"):
        other.load("small")
    assert_same_weights(before, weights(other.model))


# ---- LR finder, schedules, LR --------------------------------------------------------------


def test_lr_find_leaves_model_and_optimizer_unchanged():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    learn = make_learner(model=model)
    learn.fit(1)  # give AdamW some state and BatchNorm some statistics
    w, opt_state = weights(learn.model), copy.deepcopy(learn.opt.state_dict())
    n_rows = len(learn.recorder.values)
    lr = learn.lr_find(num_it=12)
    assert isinstance(lr, float) and lr > 0 and math.isfinite(lr)
    assert len(learn.lr_finder.losses) > 1
    assert learn.lr_finder.lrs == sorted(learn.lr_finder.lrs)
    assert_same_weights(w, weights(learn.model))
    assert opt_state_equal(opt_state, learn.opt.state_dict())
    assert len(learn.recorder.values) == n_rows  # the sweep is not recorded


def test_fit_one_cycle_lr_goes_up_then_down_and_momentum_mirrors_it():
    moms_seen = []

    class MomSpy(Callback):
        order = 20  # after the scheduler (10) set this batch's values

        def before_step(self):
            moms_seen.append(self.learn.opt.param_groups[0]["betas"][0])

    dls = make_dls(n_train=64, bs=8)
    learn = make_learner(dls=dls, cbs=[MomSpy()])
    lr_max, div, div_final = 1e-2, 25.0, 1e5
    learn.fit_one_cycle(3, lr_max=lr_max, div=div, div_final=div_final, pct_start=0.25)
    lrs = learn.recorder.lrs
    assert len(lrs) == 24 == len(moms_seen)
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    assert 0 < peak < len(lrs) - 1
    assert lrs[0] == pytest.approx(lr_max / div)
    assert all(a < b for a, b in pairwise(lrs[: peak + 1]))
    assert all(a > b for a, b in pairwise(lrs[peak:]))
    assert lrs[peak] <= lr_max and lrs[peak] > 0.9 * lr_max
    assert lrs[-1] < lr_max / div
    # Momentum is the mirror image: 0.95 at the ends, 0.85 where the LR peaks.
    for i, (lr, mom) in enumerate(zip(lrs, moms_seen, strict=True)):
        if i <= peak:
            assert (lr - lr_max / div) / (lr_max - lr_max / div) == pytest.approx(
                (0.95 - mom) / 0.1, abs=1e-6
            )
        else:
            end = lr_max / div_final
            assert (lr - end) / (lr_max - end) == pytest.approx((0.95 - mom) / 0.1, abs=1e-6)
    assert min(range(len(moms_seen)), key=moms_seen.__getitem__) == peak


def test_fit_with_lr_sets_the_lr():
    learn = make_learner(lr=1e-3)
    learn.fit(1, lr=0.05)
    assert learn.lr == 0.05
    assert all(g["lr"] == 0.05 for g in learn.opt.param_groups)
    assert learn.recorder.lrs == [0.05, 0.05]


# ---- recorder ------------------------------------------------------------------------------


def test_recorder_prints_one_header_and_one_row_per_epoch(capsys):
    learn = make_learner(metrics=[accuracy])
    learn.fit(3)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 4
    assert lines[0].split() == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    for epoch, (line, values) in enumerate(zip(lines[1:], learn.recorder.values, strict=True)):
        cells = line.split()
        assert cells[0] == str(epoch)
        assert [float(c) for c in cells[1:4]] == pytest.approx(values, abs=1e-6)
        assert re.fullmatch(r"\d\d:\d\d", cells[4])


def test_plot_loss_writes_a_png(tmp_path):
    learn = make_learner(dls=make_dls(n_train=64, bs=8))
    learn.fit(2)
    out = learn.recorder.plot_loss(tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# ---- seeding -------------------------------------------------------------------------------


def _seeded_run(seed):
    set_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 2))
    learn = Learner(make_dls(n_train=48, bs=8, shuffle=True), model, nn.CrossEntropyLoss())
    learn.fit(2)
    return weights(learn.model)


def test_set_seed_makes_two_fits_identical():
    a, b = _seeded_run(123), _seeded_run(123)
    assert_same_weights(a, b)
    c = _seeded_run(124)
    assert not torch.equal(a["0.weight"], c["0.weight"])


# ---- batch layouts -------------------------------------------------------------------------


class DictDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class DictModel(nn.Module):
    """Takes a dict batch as keyword arguments and returns logits and its own loss (Hugging Face-style)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        logits = self.lin(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, y)}


class WholeDictModel(DictModel):
    """Another calling convention: the whole dict as one argument."""

    def forward(self, batch):
        return super().forward(batch["x"], batch["y"])


@pytest.mark.parametrize("whole", [False, True])
def test_dict_batches_reach_the_model_as_keywords_or_as_the_caller_says(whole):
    xt, yt = make_data(24, seed=6)
    xv, yv = make_data(13, seed=7)
    dls = DataLoaders(
        DataLoader(DictDataset(xt, yt), batch_size=8), DataLoader(DictDataset(xv, yv), batch_size=5)
    )
    torch.manual_seed(0)
    extra = {"call_model": lambda model, xb: model(xb[0])} if whole else {}
    learn = Learner(dls, WholeDictModel() if whole else DictModel(), None, lr=0.05, **extra)
    before = weights(learn.model)
    learn.fit(2)
    assert not torch.equal(before["lin.weight"], learn.model.lin.weight)
    assert len(learn.recorder.losses) == 6
    (valid_loss,) = learn.validate()
    with torch.no_grad():
        expected = F.cross_entropy(learn.model.lin(xv), yv).item()
    assert valid_loss == pytest.approx(expected, rel=1e-6)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, xa, xb):
        return self.a(xa) + self.b(xb)


def test_two_inputs_with_n_inp_2():
    g = torch.Generator().manual_seed(8)
    xa, xb = torch.randn(30, 4, generator=g), torch.randn(30, 3, generator=g)
    y = (xa[:, 0] - xb[:, 1] > 0).long()
    ds = TensorDataset(xa, xb, y)
    dls = DataLoaders(DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=7))
    torch.manual_seed(0)
    learn = Learner(dls, TwoInputs(), nn.CrossEntropyLoss(), metrics=[accuracy], n_inp=2, lr=0.05)
    learn.fit(2)
    assert len(learn.xb) == 2 and len(learn.yb) == 1
    loss, acc = learn.validate()
    with torch.no_grad():
        out = learn.model(xa, xb)
    assert loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert acc == pytest.approx((out.argmax(-1) == y).float().mean().item(), abs=1e-7)
    preds, targets = learn.get_preds()
    assert torch.allclose(preds, out, atol=1e-6) and torch.equal(targets, y)


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("n_epoch", [-1, 1.5, "2", True])
def test_fit_with_a_bad_n_epoch(n_epoch, tmp_path):
    learn = make_learner(tmp_path)
    before = weights(learn.model)
    with pytest.raises(ValueError, match="n_epoch"):
        learn.fit(n_epoch)
    assert_same_weights(before, weights(learn.model))
    assert learn.opt is None and learn.recorder.values == []


def test_a_loss_func_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="loss_func"):
        Learner(make_dls(), nn.Linear(4, 2), 3)


def test_loss_func_none_with_a_model_that_has_no_loss_names_the_problem():
    learn = Learner(make_dls(), nn.Linear(4, 2), None)
    with pytest.raises(ValueError, match="has no 'loss'"):
        learn.fit(1)


@pytest.mark.parametrize("metric", [3, "accuracy", None])
def test_a_metric_that_is_not_callable_is_refused(metric):
    with pytest.raises(TypeError, match="metric"):
        Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=[accuracy, metric])


@pytest.mark.parametrize("lr", [-1e-3, 0, float("nan")])
def test_a_non_positive_lr_is_refused_everywhere(lr, tmp_path):
    with pytest.raises(ValueError, match="learning rate"):
        make_learner(tmp_path, lr=lr)
    learn = make_learner(tmp_path, lr=1e-3)
    learn.fit(1)
    before, opt_lr = weights(learn.model), learn.opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="learning rate"):
        learn.fit(1, lr=lr)
    with pytest.raises(ValueError, match="learning rate"):
        learn.fit_one_cycle(1, lr_max=lr)
    assert_same_weights(before, weights(learn.model))
    assert learn.opt.param_groups[0]["lr"] == opt_lr and learn.lr == 1e-3


def test_data_loaders_refuse_what_is_not_a_data_loader():
    dl = make_dls().train
    with pytest.raises(TypeError, match="train must be a torch DataLoader"):
        DataLoaders([1, 2, 3], dl)
    with pytest.raises(TypeError, match="valid must be a torch DataLoader, got TensorDataset"):
        DataLoaders(dl, dl.dataset)
    with pytest.raises(TypeError, match="train DataLoader is required"):
        DataLoaders(None, dl)
    with pytest.raises(TypeError, match="dls must be a unison.DataLoaders"):
        Learner((dl, dl), nn.Linear(4, 2), nn.CrossEntropyLoss())


def test_batch_on_another_device_than_the_model_fails_before_any_step(tmp_path):
    class ToMeta(Callback):
        def before_batch(self):
            self.learn.xb = tuple(x.to("meta") for x in self.learn.xb)

    log = EventLog()
    learn = make_learner(tmp_path, cbs=[ToMeta(), log])
    learn.save("before")
    before = weights(learn.model)
    with pytest.raises(RuntimeError, match=r"batch tensor is on meta but the model is on cpu"):
        learn.fit(1)
    assert "after_pred" not in log.events and "after_step" not in log.events
    assert_same_weights(before, weights(learn.model))
    assert learn.opt.state == {}
    learn.load("before")  # what was saved is intact
    assert_same_weights(before, weights(learn.model))


def test_a_model_without_data_fails_clearly_before_any_step():
    log = EventLog()
    learn = make_learner(model=nn.Linear(4, 2).to("meta"), cbs=[log])
    with pytest.raises(RuntimeError, match="meta"):
        learn.fit(1)
    assert "after_step" not in log.events


def test_recorder_is_the_learners():
    learn = make_learner()
    assert isinstance(learn.recorder, Recorder) and learn.get_cb(Recorder) is learn.recorder


def test_validate_without_default_callbacks():
    learn = make_learner(default_cbs=False, metrics=[accuracy])
    xv, yv = learn.dls.valid.dataset.tensors
    loss, acc = learn.validate()
    with torch.no_grad():
        out = learn.model(xv)
    assert loss == pytest.approx(F.cross_entropy(out, yv).item(), rel=1e-6)
    assert acc == pytest.approx((out.argmax(-1) == yv).float().mean().item(), abs=1e-7)


def test_a_fit_without_lr_starts_at_the_learners_lr_after_a_scheduled_fit():
    """A fit after fit_one_cycle trained at the LR the cycle's last batch left (about lr_max / div_final),
    not at `learn.lr`; each fit starts at `learn.lr`, as fastai's does and as fit_one_cycle's `lr_max=None`
    means."""
    learn = make_learner(dls=make_dls(n_train=64, bs=8), lr=1e-3)
    learn.fit_one_cycle(1, lr_max=1e-2)
    assert learn.recorder.lrs[-1] < 1e-3  # the cycle ended below learn.lr
    learn.fit(1)
    assert learn.recorder.lrs[8:] == [1e-3] * 8
    assert all(g["lr"] == 1e-3 for g in learn.opt.param_groups)

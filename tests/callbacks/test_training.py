"""Callbacks that change training: clipping, accumulation, early stopping, keeping the best model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from unison import (
    Callback,
    CancelFitException,
    Checkpoint,
    DataLoaders,
    EarlyStopping,
    GradientAccumulation,
    GradientClip,
    Learner,
    Metric,
    SaveModelCallback,
)


def regression_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)
    return x, y.unsqueeze(1)


def make_learner(bs=8, n_train=32, n_valid=8, lr=0.05, opt_func=torch.optim.SGD, scale=1.0, **kwargs):
    xt, yt = regression_data(n_train, seed=1)
    xv, yv = regression_data(n_valid, seed=2)
    dls = DataLoaders(
        DataLoader(TensorDataset(xt * scale, yt * scale), batch_size=bs),
        DataLoader(TensorDataset(xv, yv), batch_size=bs),
    )
    torch.manual_seed(0)
    return Learner(dls, nn.Linear(4, 1), nn.MSELoss(), opt_func=opt_func, lr=lr, **kwargs)


def grad_norm(model):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


class GradNormSpy(Callback):
    """Records the global gradient norm at `before_step`, at its `order`."""

    def __init__(self, order):
        self.order = order
        self.norms = []

    def before_step(self):
        self.norms.append(grad_norm(self.learn.model))


def test_gradient_clip_clips_the_global_norm():
    before, after = GradNormSpy(order=-5), GradNormSpy(order=5)
    learn = make_learner(scale=10.0, cbs=[GradientClip(max_norm=0.5), before, after])
    learn.fit(2)
    assert len(before.norms) == len(after.norms) == 8
    assert min(before.norms) > 0.5  # there was something to clip
    for clipped in after.norms:
        assert clipped <= 0.5 * (1 + 1e-5)
        assert clipped == pytest.approx(0.5, rel=1e-4)


def test_gradient_clip_leaves_small_gradients_alone():
    before, after = GradNormSpy(order=-5), GradNormSpy(order=5)
    learn = make_learner(lr=1e-4, cbs=[GradientClip(max_norm=1e6), before, after])
    learn.fit(1)
    assert before.norms == pytest.approx(after.norms, rel=1e-6)


def test_gradient_clip_refuses_a_non_positive_norm():
    with pytest.raises(ValueError, match="max_norm"):
        GradientClip(0)


def _weights_after(bs, cbs=(), n_epoch=2):
    learn = make_learner(bs=bs, n_train=32, lr=0.05, cbs=list(cbs))
    learn.fit(n_epoch)
    return {k: v.detach().clone() for k, v in learn.model.state_dict().items()}, learn


def test_gradient_accumulation_matches_a_larger_batch():
    steps = []

    class CountSteps(Callback):
        def after_step(self):
            steps.append(self.learn.iter)

    accumulated, learn = _weights_after(4, cbs=[GradientAccumulation(n_acc=2), CountSteps()])
    big, _ = _weights_after(8)
    small, _ = _weights_after(4)
    for k in big:
        torch.testing.assert_close(accumulated[k], big[k], atol=1e-6, rtol=0)
    assert not torch.allclose(small["weight"], big["weight"], atol=1e-4)  # accumulation mattered
    assert steps == [1, 3, 5, 7] * 2  # one step every two micro-batches
    assert learn.grad_sync is True
    # The recorded training losses are the micro-batches' own (not divided by n_acc).
    assert len(learn.recorder.losses) == 16


def test_gradient_accumulation_steps_on_the_last_batch_of_an_epoch():
    steps = []

    class CountSteps(Callback):
        def after_step(self):
            steps.append(self.learn.iter)

    learn = make_learner(bs=8, n_train=40, cbs=[GradientAccumulation(n_acc=3), CountSteps()])
    learn.fit(1)
    assert steps == [2, 4]  # 5 batches: a step after the 3rd and after the last


@pytest.mark.parametrize("n_acc", [0, -1, 1.5])
def test_gradient_accumulation_refuses_bad_n_acc(n_acc):
    with pytest.raises(ValueError, match="n_acc"):
        GradientAccumulation(n_acc)


class Scripted(Metric):
    """A metric whose value at each validation is taken from a script: a monitored value we control."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0
        super().__init__("scripted")

    def update(self, pred, *targets):
        pass

    def compute(self):
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def test_early_stopping_stops_after_patience_epochs_without_improvement(capsys):
    # Improves at epochs 0, 1, 2 (by 1.0, more than min_delta), then only by 0.1: not enough.
    metric = Scripted([1.0, 2.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5])
    stop = EarlyStopping(monitor="scripted", min_delta=0.5, patience=2)
    learn = make_learner(metrics=[metric], cbs=[stop])
    learn.fit(8)
    assert len(learn.recorder.values) == 5  # epochs 0..4: two epochs (3, 4) without improvement
    assert learn.epoch == 4
    assert stop.best == 3.0 and stop.wait == 2
    assert "No improvement in scripted for 2 epochs: stopping at epoch 4." in capsys.readouterr().out


def test_early_stopping_on_valid_loss_with_a_model_that_cannot_improve():
    stop = EarlyStopping(monitor="valid_loss", min_delta=10.0, patience=3)
    learn = make_learner(lr=1e-12, cbs=[stop])
    learn.fit(10)
    assert len(learn.recorder.values) == 4  # epoch 0 sets the best, 1..3 do not beat it by 10
    losses = [row[1] for row in learn.recorder.values]
    assert max(losses) - min(losses) < 1e-6


def test_early_stopping_refuses_an_unknown_monitor():
    learn = make_learner(cbs=[EarlyStopping(monitor="nope")])
    with pytest.raises(ValueError, match="cannot monitor 'nope'"):
        learn.fit(1)


def test_save_model_callback_writes_the_best_model_and_reloads_it(tmp_path):
    per_epoch = []

    class Snapshot(Callback):
        order = 80

        def after_epoch(self):
            per_epoch.append({k: v.detach().clone() for k, v in self.learn.model.state_dict().items()})

    metric = Scripted([1.0, 3.0, 2.0, 2.5])  # best at epoch 1
    save = SaveModelCallback(monitor="scripted", fname="best")
    learn = make_learner(path=tmp_path, metrics=[metric], cbs=[save, Snapshot()])
    learn.fit(4)
    file = tmp_path / "models" / "best.pth"
    assert file.is_file()
    assert not torch.equal(per_epoch[1]["weight"], per_epoch[3]["weight"])  # training went on
    for k, v in learn.model.state_dict().items():
        assert torch.equal(v, per_epoch[1][k]), k
    assert save.best == 3.0

    # The file itself holds epoch 1's weights.
    other = make_learner(path=tmp_path)
    other.load("best")
    assert torch.equal(other.model.weight, per_epoch[1]["weight"])


class StopAfterEpoch(Callback):
    """Simulates a crash after `epoch` ends (after the Checkpoint callback, order 90, saved it)."""

    order = 95

    def __init__(self, epoch):
        self.epoch = epoch

    def after_epoch(self):
        if self.learn.epoch == self.epoch:
            raise CancelFitException()


def test_early_stopping_resumed_run_stops_where_an_uninterrupted_one_does(tmp_path):
    def run(path, cbs, resume=False):
        learn = make_learner(lr=1e-12, path=path, cbs=[EarlyStopping(min_delta=10.0, patience=3), *cbs])
        learn.fit(10, resume=resume)
        return learn

    whole = run(tmp_path / "whole", [])
    assert len(whole.recorder.values) == 4  # epoch 0 sets the best; 1, 2, 3 do not beat it

    run(tmp_path / "cut", [Checkpoint(), StopAfterEpoch(1)])
    resumed = run(tmp_path / "cut", [Checkpoint()], resume=True)
    assert resumed.get_cb(EarlyStopping).wait == 3
    assert len(resumed.recorder.values) == 4  # stops at epoch 3, as the uninterrupted run


def test_fresh_fits_track_afresh(tmp_path):
    stop = EarlyStopping(monitor="scripted", patience=1)
    learn = make_learner(path=tmp_path, metrics=[Scripted([5.0, 4.0, 1.0, 2.0, 1.5])], cbs=[stop])
    learn.fit(5)
    assert len(learn.recorder.values) == 2 and stop.best == 5.0  # 4.0 < 5.0: stop after epoch 1
    learn.fit(5)  # a new fit: 1.0 is its first value and the best so far, 2.0 improves, 1.5 does not
    assert stop.best == 2.0 and len(learn.recorder.values) == 2 + 3


def test_save_model_callback_resumed_run_still_reloads_the_best(tmp_path):
    def run(path, values, cbs, resume=False):
        save = SaveModelCallback(monitor="scripted", fname="best")
        learn = make_learner(path=path, metrics=[Scripted(values)], cbs=[save, *cbs])
        learn.fit(4, resume=resume)
        return learn

    whole = run(tmp_path / "whole", [1.0, 3.0, 2.0, 2.5], [])
    run(tmp_path / "cut", [1.0, 3.0], [Checkpoint(), StopAfterEpoch(1)])  # best (epoch 1) saved, then a crash
    resumed = run(tmp_path / "cut", [2.0, 2.5], [Checkpoint()], resume=True)  # epochs 2, 3 do not improve
    assert len(resumed.recorder.values) == 4
    assert torch.equal(resumed.model.weight, whole.model.weight)  # both end on epoch 1's weights
    assert torch.equal(resumed.model.bias, whole.model.bias)


def test_lr_find_ignores_trackers_and_leaves_their_state_and_files(tmp_path):
    plain = make_learner(path=tmp_path / "plain")
    expected = plain.lr_find(num_it=10)

    stop, save = EarlyStopping(patience=1), SaveModelCallback(fname="best")
    learn = make_learner(path=tmp_path, cbs=[stop, save])
    assert learn.lr_find(num_it=10) == expected  # before any fit: the sweep is not an epoch to track
    assert len(learn.lr_finder.losses) == 10
    assert not (tmp_path / "models" / "best.pth").exists()

    learn.fit(3)
    best_file = tmp_path / "models" / "best.pth"
    saved_bytes, state = best_file.read_bytes(), (stop.best, stop.wait, save.best)
    learn.lr_find(num_it=10)
    assert len(learn.lr_finder.losses) == 10  # not cut short by EarlyStopping on stale values
    assert best_file.read_bytes() == saved_bytes
    assert (stop.best, stop.wait, save.best) == state


def test_lr_find_writes_no_checkpoint_for_a_resumed_fit_to_start_from(tmp_path):
    """lr_find's sweep saved checkpoints (Checkpoint(every=2)): `fit(1, resume=True)` then resumed at the
    sweep's step 10 from its diverged weights, on the first run of the script."""
    whole = make_learner(path=tmp_path / "whole")  # independent: the same fit without the sweep
    whole.fit(1)

    learn = make_learner(path=tmp_path / "swept", cbs=[Checkpoint(every=2)])
    learn.lr_find(num_it=10, end_lr=100)
    assert not (tmp_path / "swept" / "models" / "checkpoint.pth").exists()
    assert [type(cb).__name__ for cb in learn.cbs].count("Checkpoint") == 1  # still there for the fit
    learn.fit(1, resume=True)
    assert (tmp_path / "swept" / "models" / "checkpoint.pth").exists()
    assert torch.equal(learn.model.weight, whole.model.weight)
    assert torch.equal(learn.model.bias, whole.model.bias)
    assert learn.recorder.losses == whole.recorder.losses


class Stream(IterableDataset):
    """The regression set as a stream: no len()."""

    def __init__(self, n):
        self.x, self.y = regression_data(n, seed=1)

    def __iter__(self):
        return zip(self.x, self.y, strict=True)


def _plain_accumulated(n_acc, bs=8, n_batches=4, epochs=2, n_items=32):
    """One process over the first `n_batches` of the `n_items` of `Stream(n_items)`, the last
    batches of each epoch ending in a step, as the callback promises."""
    x, y = regression_data(n_items, seed=1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for start in range(0, n_batches, n_acc):
            chunk = range(start, min(start + n_acc, n_batches))
            for i in chunk:
                xb, yb = x[i * bs : (i + 1) * bs], y[i * bs : (i + 1) * bs]
                (F.mse_loss(model(xb), yb, reduction="sum") / (bs * len(chunk))).backward()
            opt.step()
            opt.zero_grad()
    return model


def test_gradient_accumulation_over_a_stream_of_unknown_length_is_refused_before_a_step():
    """It never saw an epoch's last batch (no len()): that batch's gradient was carried into the next
    epoch's first step, and the last epoch's never applied."""

    def stream_learner(**kwargs):
        torch.manual_seed(0)
        dls = DataLoaders(DataLoader(Stream(32), batch_size=8), None)
        return Learner(dls, nn.Linear(4, 1), nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.05, **kwargs)

    learn = stream_learner()
    before = learn.model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"GradientAccumulation.*no len\(\).*steps_per_epoch"):
        learn.fit(2, cbs=[GradientAccumulation(3)])
    assert torch.equal(learn.model.weight, before)

    learn = stream_learner(steps_per_epoch=4)  # the epoch's length given: its last batch ends a step
    learn.fit(2, cbs=[GradientAccumulation(3)])
    expected = _plain_accumulated(3)
    torch.testing.assert_close(learn.model.weight, expected.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(learn.model.bias, expected.bias, atol=1e-6, rtol=0)


def test_a_stream_that_ends_before_steps_per_epoch_inside_an_accumulated_step_is_refused():
    """3 batches where steps_per_epoch says 4: the epoch ended on a micro-batch whose gradient was
    carried into the next epoch's step. Refused there, the weights those of the last real step."""
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(Stream(24), batch_size=8), None)
    learn = Learner(dls, nn.Linear(4, 1), nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.05, steps_per_epoch=4)
    with pytest.raises(
        ValueError, match=r"ended after 3 of steps_per_epoch=4 batches.*GradientAccumulation\(2\)"
    ):
        learn.fit(2, cbs=[GradientAccumulation(2)])
    expected = _plain_accumulated(2, n_batches=2, epochs=1, n_items=24)  # the step of batches 0 and 1
    torch.testing.assert_close(learn.model.weight, expected.weight, atol=1e-6, rtol=0)

"""A resume whose script changed what the checkpoint depends on: the optimizer kind or its param groups,
the dataset's length, the batches a step accumulates. Each one is exact (the same global batch
reached another way), warned (the run goes on, no longer the uninterrupted one), or refused in one
line before anything changes; never silently off the uninterrupted run."""

import contextlib
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.test_run import _data, _model
from unison import (
    Callback,
    Checkpoint,
    CheckpointError,
    DataLoaders,
    GradientAccumulation,
    Learner,
    Run,
    set_seed,
)
from unison.checkpoint.callback import GlobalBatchChangedWarning


class Stop(Exception):
    """Stands for a crash."""


class StopAt(Callback):
    order = 95  # after Checkpoint wrote this batch's state

    def __init__(self, at):
        self.at, self.count = at, 0

    def after_batch(self):
        if self.learn.training:
            self.count += 1
            if self.count == self.at:
                raise Stop()


def _learner(path, bs=8, items=48, init_seed=0, opt_func=torch.optim.SGD, cbs=(), splitter=None, every=1):
    set_seed(init_seed)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 5, generator=g)
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:items], y[:items]), batch_size=bs, shuffle=True),
        DataLoader(TensorDataset(x[80:], y[80:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    extra = {"splitter": splitter} if splitter is not None else {}
    learn = Learner(
        dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=path, opt_func=opt_func,
        cbs=[Checkpoint(every=every), *cbs], **extra,
    )  # fmt: skip
    learn.data_seed = 1234
    return learn


def _fit(learn, cbs=(), resume=False):
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit(2, cbs=list(cbs), resume=resume)


def _crash(path, at, **kwargs):
    with pytest.raises(Stop):
        _fit(_learner(path, **kwargs), cbs=[StopAt(at)])


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_the_same_global_batch_by_accumulation_resumes_exactly_and_another_is_warned(tmp_path):
    reference = _learner(tmp_path / "ref", cbs=[GradientAccumulation(2)])
    _fit(reference)
    _crash(tmp_path / "run", 4, cbs=[GradientAccumulation(2)])  # 2 steps of 2 batches of 8
    once = _learner(tmp_path / "run", bs=16, init_seed=9)  # each step's 16 items in one batch
    with warnings.catch_warnings():
        warnings.simplefilter("error", GlobalBatchChangedWarning)
        _fit(once, resume=True)
    assert _max_diff(_weights(reference), _weights(once)) < 1e-6
    _crash(tmp_path / "more", 4, cbs=[GradientAccumulation(2)])
    more = _learner(tmp_path / "more", cbs=[GradientAccumulation(4)])  # 32 items a step: not the run
    with pytest.warns(GlobalBatchChangedWarning, match="global batch of 32 .* accumulate 4.* had 16"):
        _fit(more, resume=True)
    _crash(tmp_path / "cut", 2, cbs=[GradientAccumulation(2)])  # 16 items in: half a step of 32
    with pytest.raises(CheckpointError, match="not a whole number of global batches of 32"):
        _fit(_learner(tmp_path / "cut", cbs=[GradientAccumulation(4)]), resume=True)


def _run(ds, path, accumulate, bs, crash_at=None, resume=False):
    torch.manual_seed(0)
    model = _model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with Run(accumulate=accumulate, path=path) as run:
        model, opt = run.setup(model, opt)
        train = run.loader(DataLoader(ds, batch_size=bs, shuffle=True))
        run.checkpoint(every=accumulate)
        for epoch in run.epochs(2, resume=resume):
            model.train()
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
                if (epoch, run.batch) == crash_at:
                    raise Stop()
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def test_run_resumed_with_another_accumulate_is_exact_at_the_same_global_batch_else_warned(tmp_path):
    ds = _data(48)
    whole = _run(ds, tmp_path / "whole", accumulate=2, bs=4)
    with pytest.raises(Stop):
        _run(ds, tmp_path / "cut", accumulate=2, bs=4, crash_at=(0, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GlobalBatchChangedWarning)
        resumed = _run(ds, tmp_path / "cut", accumulate=1, bs=8, resume=True)
    assert _max_diff(whole, resumed) < 1e-6
    with pytest.raises(Stop):
        _run(ds, tmp_path / "fewer", accumulate=2, bs=4, crash_at=(0, 5))
    with pytest.warns(GlobalBatchChangedWarning, match="global batch of 4 .* had 8"):
        _run(ds, tmp_path / "fewer", accumulate=1, bs=4, resume=True)


def test_a_resume_over_a_dataset_of_another_length_is_refused_before_any_change(tmp_path):
    _crash(tmp_path, 3)  # 24 of 48 items into epoch 0
    longer = _learner(tmp_path, items=64, init_seed=9)
    before = _weights(longer)
    with pytest.raises(
        CheckpointError, match="24 samples into epoch 0 of a dataset of 48 items, this run's has 64"
    ):
        _fit(longer, resume=True)
    assert all(torch.equal(before[k], _weights(longer)[k]) for k in before)  # refused before any change
    _crash(tmp_path / "end", 7, every=None)  # in epoch 1: the checkpoint of epoch 0's end
    with pytest.raises(CheckpointError, match=r"another train dataset \(48 items, this run's has 64\)"):
        _fit(_learner(tmp_path / "end", items=64, every=None), resume=True)


def _fold(path, fold):
    """A k-fold loop's learner: the same model on the fold's 48 items, checkpoints in one folder."""
    set_seed(fold)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 5, generator=g)
    y = (x.sum(1) > 0).long()
    train = slice(48 * fold, 48 * (fold + 1))
    dls = DataLoaders(
        DataLoader(TensorDataset(x[train], y[train]), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8),
    )
    return Learner(dls, nn.Linear(5, 2), nn.CrossEntropyLoss(), lr=0.1, path=path, cbs=[Checkpoint(every=2)])


def test_a_second_run_writing_the_same_checkpoint_file_is_refused_not_taken_as_its_own(tmp_path):
    """Two folds of a k-fold loop, each `fit(2, resume=True)` with `Checkpoint()` in one folder: the
    second found the first's finished checkpoint and ended, silently, on the first fold's weights."""
    first = _fold(tmp_path, 0)
    _fit(first, resume=True)
    second = _fold(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"another train dataset \(its items differ from this run's\)"):
        _fit(second, resume=True)
    alone = _fold(tmp_path / "alone", 1)
    _fit(alone, resume=True)
    again = _fold(tmp_path / "alone", 1)
    _fit(again, resume=True)  # its own checkpoint: resumed (finished), not refused
    assert torch.equal(again.raw_model.weight, alone.raw_model.weight)


def _two_groups(model):
    return [list(model[0].parameters()), list(model[3].parameters())]


@pytest.mark.parametrize(
    ("first", "then", "refused"),
    [
        (
            {"opt_func": torch.optim.SGD},
            {"opt_func": torch.optim.Adam},
            "optimizer SGD, this run trains with Adam",
        ),
        (
            {"opt_func": torch.optim.Adam},
            {"opt_func": torch.optim.AdamW},
            "optimizer Adam, this run trains with AdamW",
        ),
        ({}, {"splitter": _two_groups}, r"param groups of \[4\] tensors, this run's has \[2, 2\]"),
    ],
)
def test_a_checkpoint_of_another_optimizer_or_param_groups_is_refused_before_any_change(
    tmp_path, first, then, refused
):
    _crash(tmp_path, 3, **first)
    resumed = _learner(tmp_path, init_seed=9, **then)
    before = _weights(resumed)
    with pytest.raises(CheckpointError, match=refused):
        _fit(resumed, resume=True)
    assert all(torch.equal(before[k], _weights(resumed)[k]) for k in before)


def test_a_one_cycle_resumed_over_another_length_or_peak_is_warned_the_same_is_exact(tmp_path):
    """`fit_one_cycle(2)` crashed, then `fit_one_cycle(3, resume=True)`: the first part followed the
    2-epoch schedule, so the run equals neither uninterrupted one (0.014 off the 3-epoch one)."""

    def crashed(path):
        learn = _learner(path, cbs=[StopAt(8)])  # epoch 1, batch 2 of 6
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(Stop):
            learn.fit_one_cycle(2, lr_max=1e-2)

    crashed(tmp_path / "a")
    with pytest.warns(
        UserWarning, match=r"one-cycle schedule of 2 epoch\(s\) at lr_max 0.01 .* 3 epoch\(s\) at lr_max 0.01"
    ):
        with contextlib.redirect_stdout(io.StringIO()):
            _learner(tmp_path / "a").fit_one_cycle(3, lr_max=1e-2, resume=True)
    crashed(tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same schedule: no warning, and the uninterrupted weights
        with contextlib.redirect_stdout(io.StringIO()):
            resumed = _learner(tmp_path / "b")
            resumed.fit_one_cycle(2, lr_max=1e-2, resume=True)
    whole = _learner(tmp_path / "c")
    with contextlib.redirect_stdout(io.StringIO()):
        whole.fit_one_cycle(2, lr_max=1e-2)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(a, b)

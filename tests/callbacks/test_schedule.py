"""torch's ReduceLROnPlateau driven by the loop: stepped once per epoch on a recorded value (the
validation loss or a named metric), which is the same on every rank, so W processes keep one LR."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.test_workloads import make_dls, max_diff, quiet, weights
from unison import Callback, Learner, LRSchedulerCallback, accuracy, set_seed


class EpochLRs(Callback):
    order = 60  # after the scheduler's step

    def __init__(self):
        self.lrs = []

    def after_epoch(self):
        self.lrs.append(self.learn.opt.param_groups[0]["lr"])


def plateau(monitor="valid_loss"):
    # threshold=0.5: an epoch must improve by half to count, so the LR drops on most epochs
    make = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(  # noqa: E731
        opt, mode="min" if "loss" in monitor else "max", patience=0, factor=0.5, threshold=0.5
    )
    return LRSchedulerCallback(make, monitor=monitor)


def _fit(bs, monitor, distributed):
    set_seed(0)
    learn = Learner(
        make_dls(64, 32, bs=bs), nn.Linear(4, 2), nn.CrossEntropyLoss(), lr=0.05, metrics=[accuracy]
    )
    log = EpochLRs()
    cbs = [plateau(monitor), log]
    with quiet():
        if distributed:
            with learn.distrib_ctx():
                learn.fit(4, cbs=cbs)
        else:
            learn.fit(4, cbs=cbs)
    return log.lrs, [row[1:] for row in learn.recorder.values], weights(learn)


@pytest.mark.parametrize("monitor", ["valid_loss", "accuracy"])
def test_reduce_lr_on_plateau_steps_once_an_epoch_on_the_recorded_value(monitor):
    """Issue 18.5: `ReduceLROnPlateau` crashed (`step()` needs the metric)."""
    lrs, values, _ = _fit(16, monitor, distributed=False)
    # independent: torch's own scheduler fed the recorded values by hand
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched = plateau(monitor).make_scheduler(opt)
    column = 0 if monitor == "valid_loss" else 1
    expected = []
    for row in values:
        sched.step(row[column])
        expected.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected) and min(lrs) < 0.05  # it did reduce


def test_a_plateau_monitor_that_is_not_recorded_is_refused_before_training():
    set_seed(0)
    learn = Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss())
    with quiet(), pytest.raises(ValueError, match="cannot monitor 'f1'"):
        learn.fit(1, cbs=[plateau("f1")])
    assert learn.recorder.values == []


def _parity():
    world = dist.get_world_size()
    return _fit(16 * world, "valid_loss", False), _fit(16, "valid_loss", True)


@pytest.mark.slow
def test_reduce_lr_on_plateau_gives_every_rank_the_lrs_of_one_process(pool2):
    for (lrs1, values1, w1), (lrs2, values2, w2) in pool2.run(_parity, timeout=120):
        assert lrs2 == lrs1 and min(lrs1) < 0.05
        assert torch.tensor(values2).sub(torch.tensor(values1)).abs().max() < 1e-6
        assert max_diff(w1, w2) < 1e-6


# ---- a torch scheduler in a second fit -----------------------------------------------------------
class StepLRs(Callback):
    order = 60  # the LR each optimizer step takes

    def __init__(self):
        self.lrs = []

    def before_step(self):
        self.lrs.append(self.learn.opt.param_groups[0]["lr"])


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))


def test_a_second_fit_builds_its_torch_scheduler_on_that_fits_lr():
    """A torch scheduler built at the second fit took the first fit's `initial_lr`, which torch keeps in
    the param groups, as its base: `fit(1, lr=0.01)` warmed up to the first fit's 0.05."""
    set_seed(0)
    learn = Learner(make_dls(64, 8, bs=8), nn.Linear(4, 2), nn.CrossEntropyLoss(), opt_func=torch.optim.SGD)
    first, second = StepLRs(), StepLRs()
    with quiet():
        learn.fit(1, lr=0.05, cbs=[LRSchedulerCallback(warmup), first])
        learn.fit(1, lr=0.01, cbs=[LRSchedulerCallback(warmup), second])

    def torch_lrs(lr):  # independent: torch's scheduler on a fresh optimizer at that LR
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        sched, lrs = warmup(opt), []
        for _ in range(8):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return lrs

    assert first.lrs == pytest.approx(torch_lrs(0.05))
    assert second.lrs == pytest.approx(torch_lrs(0.01))


# ---- a torch scheduler across a resume (issue 48.2) ----------------------------------------------
class CrashAt(Callback):
    """A crash after the Checkpoint callback (order 90) saved batch `it` of `epoch`."""

    order = 95

    def __init__(self, epoch, it):
        self.at = (epoch, it)

    def after_batch(self):
        if self.learn.training and (self.learn.epoch, self.learn.iter) == self.at:
            raise RuntimeError("crash")


def _one_cycle_fit(path, cbs, resume=False):
    from unison import Checkpoint

    set_seed(0)
    learn = Learner(make_dls(40, 8, bs=4), nn.Linear(4, 2), nn.CrossEntropyLoss(), path=path)
    sched = LRSchedulerCallback(
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=30)
    )
    with quiet():
        learn.fit(3, lr=0.05, cbs=[sched, Checkpoint(every=2), *cbs], resume=resume)
    return learn


def test_a_resumed_one_cycle_lr_scheduler_callback_ends_on_the_uninterrupted_weights(tmp_path):
    """The scheduler is built after the checkpoint is loaded: its constructor must not leave its
    first step's LR (and momentum) in the optimizer."""
    whole = _one_cycle_fit(tmp_path / "whole", [])
    with pytest.raises(RuntimeError, match="crash"):
        _one_cycle_fit(tmp_path / "cut", [CrashAt(1, 4)])  # saved at batch 4 (every=2), then dies
    resumed = _one_cycle_fit(tmp_path / "cut", [], resume=True)
    expected, got = weights(whole), weights(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected), max_diff(got, expected)
    assert resumed.opt.param_groups[0]["lr"] == whole.opt.param_groups[0]["lr"]


@pytest.mark.launch
def test_a_sigkilled_rank_under_max_restarts_resumes_lr_scheduler_callback_bit_equal(tmp_path):
    """Issue 48.2 under the real launcher: rank 1 SIGKILLed at epoch 1 (step 6 of 8), restarted, resumed
    from the checkpoint: the same weights as the uninterrupted run, bit for bit (`fit_one_cycle`'s
    own schedule does so too)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "fault_scripts" / "resumable.py"

    def launch(folder, *extra):
        cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--max-restarts", "1", str(script)]
        proc = subprocess.run(
            [*cmd, "--dir", str(folder), "--lr-scheduler", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, sorted(line.split()[-1] for line in proc.stdout.splitlines() if "WEIGHTS" in line)

    _, whole = launch(tmp_path / "whole")
    proc, killed = launch(tmp_path / "killed", "--kill-rank", "1", "--at", "6")
    assert "restart" in proc.stderr.lower()  # it did die and come back
    assert len(whole) == 2 and whole[0] == whole[1] and killed == whole


def _one_cycle_of_the_loaders_batches(counted):
    """A per-process batch of the global 16 over W, and a OneCycleLR as long as the DataLoader's
    batches ("loader": W times the fit's steps on W processes) or the fit's steps ("steps")."""
    world = dist.get_world_size()
    set_seed(0)
    dls = make_dls(64, 32, bs=16 // world)
    total = 2 * (len(dls.train) if counted == "loader" else 64 // 16)
    one_cycle = lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)  # noqa: E731
    learn = Learner(dls, nn.Linear(4, 2), nn.CrossEntropyLoss(), lr=0.05)
    try:
        with quiet(), learn.distrib_ctx():
            learn.fit(2, cbs=[LRSchedulerCallback(one_cycle)])
    except ValueError as exc:
        return str(exc)
    return learn.opt.param_groups[0]["lr"]


def test_a_schedule_as_long_as_the_dataloaders_batches_is_refused_on_w_processes(pool2):
    """On W processes each rank takes 1/W of the DataLoader's batches: the schedule would stop
    half way where the same script on one process ends it."""
    for message in pool2.run(_one_cycle_of_the_loaders_batches, "loader"):
        assert message.startswith("fit(2): the LR scheduler's total_steps=16 counts the "), message
        assert "total_steps=8 " in message
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8)
    for _ in range(8):  # the fit's 8 steps, each followed by the scheduler's
        opt.step()
        one_cycle.step()
    lrs = pool2.run(_one_cycle_of_the_loaders_batches, "steps")
    assert lrs[0] == lrs[1] == pytest.approx(opt.param_groups[0]["lr"])

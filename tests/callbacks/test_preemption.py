"""Preemption on one process: a real signal at random moments (a step, validation, a checkpoint
write), a checkpoint written at once whatever `every`, exit status 75, and the resumed run on the
weights of an uninterrupted one; the signal handlers given back after fit; SLURM's requeue with a
fake `scontrol` on PATH (a shell script that records its arguments) and without one.

Multi-process jobs under `unison launch` are in tests/launch/test_preemption_launch.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.hangs import run_or_report
from unison import Callback, Checkpoint, DataLoaders, Learner, set_seed
from unison.callbacks.preemption import PREEMPTED_EXIT, Preempted, Preemption
from unison.checkpoint import store as checkpoint_store
from unison.distributed.slurm import job_to_requeue, requeue
from unison.signals import launcher_signals, parse_signals, preempt_signals

EPOCHS, STEPS = 3, 6  # 48 items, batch 8: 6 steps an epoch, 18 in all


def _learner(path: Path, every: int | None = 4, cbs=(), **kwargs) -> Learner:
    set_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5, generator=g)
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:48], y[:48]), batch_size=8, shuffle=True),
        DataLoader(TensorDataset(x[48:], y[48:]), batch_size=8),
    )
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    ckpt = [Checkpoint(every=every)] if every != 0 else []
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, path=path, cbs=[*ckpt, *cbs], **kwargs)
    learn.data_seed = 1234
    return learn


def _fit(learn: Learner, resume: bool = False) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit_one_cycle(EPOCHS, lr_max=1e-2, resume=resume)


def _weights(learn: Learner) -> list[torch.Tensor]:
    return [t.detach().clone() for t in learn.raw_model.state_dict().values()]


class SignalAt(Callback):
    """Sends `sig` to this very process (a real signal: the kernel delivers it, Python runs the
    handler) once, at training step `at` ("step"), in the first validation batch after it
    ("validate"), or as the first checkpoint write after it begins ("save")."""

    order = 96

    def __init__(self, at: int, phase: str, sig: signal.Signals = signal.SIGTERM):
        self.at, self.phase, self.sig = at, phase, sig
        self.steps, self.sent = 0, False

    def send(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)

    @property
    def armed(self) -> bool:
        return self.steps >= self.at

    def after_step(self) -> None:
        self.steps += 1
        if self.phase == "step" and self.armed:
            self.send()

    def after_pred(self) -> None:
        if self.phase == "validate" and self.armed and not self.learn.training:
            self.send()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    learn = _learner(tmp_path_factory.mktemp("whole"))
    _fit(learn)
    return _weights(learn)


def _preempt_then_resume(path: Path, at: int, phase: str, sig: signal.Signals, monkeypatch) -> Preempted:
    cue = SignalAt(at, phase, sig)
    real_save = checkpoint_store.atomic_save

    def save_with_signal(*args, **kwargs):
        if phase == "save" and cue.armed:
            cue.send()  # handled at once: the flag is set while this write runs
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_store, "atomic_save", save_with_signal)
    learn = _learner(path, cbs=[cue])
    with pytest.raises(Preempted) as stopped:
        _fit(learn)
    monkeypatch.setattr(checkpoint_store, "atomic_save", real_save)
    state = torch.load(path / "models" / "checkpoint.pth", weights_only=True)
    stopped.value.position = (state["epoch"], state["steps_done"])  # type: ignore[attr-defined]
    resumed = _learner(path)
    _fit(resumed, resume=True)
    stopped.value.resumed_weights = _weights(resumed)  # type: ignore[attr-defined]
    return stopped.value


def test_a_signal_at_random_moments_stops_checkpointed_and_resumes_to_the_same_weights(
    tmp_path: Path, uninterrupted: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten moments drawn at random (seeded), over steps, validation and checkpoint writes, SIGTERM and
    SIGUSR1: each run stops with status 75 at one step boundary, having written a checkpoint there
    (Checkpoint(every=4): most moments fall between two of its saves), and the resumed run ends on the
    uninterrupted weights, bit for bit. The process's own SIGTERM handler is back after each fit."""
    rng = random.Random(22)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    phases = ["step", "validate", "save"] * 4
    positions = set()
    for run in range(10):
        phase = phases[run]
        at = rng.randint(1, EPOCHS * STEPS - (STEPS if phase == "validate" else 1))
        sig = rng.choice([signal.SIGTERM, signal.SIGUSR1])
        stopped = _preempt_then_resume(tmp_path / f"run{run}", at, phase, sig, monkeypatch)
        what = f"run {run}: {phase} at step {at}, {sig.name}"
        assert stopped.code == PREEMPTED_EXIT == 75, what
        assert stopped.signame == sig.name, what
        assert stopped.saved == str(tmp_path / f"run{run}" / "models" / "checkpoint.pth"), what
        assert str(stopped).startswith(f"preempted by {sig.name}: every rank stopped "), str(stopped)
        # the checkpoint is where every rank stopped: the signal's step (or its epoch's end), not an
        # earlier save of every=4
        where = (stopped.epoch + 1, 0) if stopped.step is None else (stopped.epoch, stopped.step)
        assert stopped.position == where, what  # type: ignore[attr-defined]
        steps_done = stopped.epoch * STEPS + (STEPS if stopped.step is None else stopped.step)
        if phase == "step":
            assert steps_done == at, what
        elif phase == "save":  # the first write of Checkpoint(every=4) at or after step `at`
            assert steps_done == next(s for s in range(at, 99) if s % STEPS in (0, 4)), what
        else:  # the end of the epoch whose validation heard it
            assert stopped.step is None and steps_done == STEPS * -(-at // STEPS), what
        positions.add(where)
        for got, want in zip(stopped.resumed_weights, uninterrupted, strict=True):  # type: ignore[attr-defined]
            assert torch.equal(got, want), what
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before, what
    assert len(positions) >= 6, positions  # the moments were spread


def test_the_checkpoint_is_written_at_the_signals_step_whatever_every_is(tmp_path: Path) -> None:
    """Checkpoint(every=100) would not write before the epoch's end; the signal after step 2 makes it
    write there: the checkpoint's position is step 2 of epoch 0, and a script's own handler still
    hears the signal (chained)."""
    heard = []
    previous = signal.signal(signal.SIGTERM, lambda *_: heard.append("script"))
    try:
        learn = _learner(tmp_path, every=100, cbs=[SignalAt(2, "step")])
        with pytest.raises(Preempted) as stopped:
            _fit(learn)
        assert signal.getsignal(signal.SIGTERM) is not previous  # the script's, given back
        assert heard == ["script"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    state = torch.load(tmp_path / "models" / "checkpoint.pth", weights_only=True)
    assert (state["epoch"], state["steps_done"]) == (0, 2)
    assert stopped.value.epoch == 0 and stopped.value.step == 2


def test_without_a_checkpoint_callback_one_line_says_nothing_was_saved(tmp_path: Path) -> None:
    learn = _learner(tmp_path, every=0, cbs=[SignalAt(3, "step")])
    with pytest.raises(Preempted) as stopped:
        _fit(learn)
    assert stopped.value.saved is None and stopped.value.code == 75
    assert str(stopped.value) == (
        "preempted by SIGTERM: every rank stopped in epoch 0, after step 3; "
        "no Checkpoint callback, so nothing was saved"
    )
    assert not (tmp_path / "models").exists()


def _in_a_child(imports: str, call: str) -> subprocess.CompletedProcess:
    """Run `call` in a fresh interpreter (its signals, its exit) with this repository on its path,
    after `from tests.callbacks.test_preemption import <imports>`; output captured as text."""
    root = Path(__file__).resolve().parents[2]
    code = f"import signal\nfrom tests.callbacks.test_preemption import {imports}\n{call}\n"
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    return run_or_report([sys.executable, "-c", code], 120, env=env)


@pytest.mark.procs  # a fresh interpreter: about 5 s
def test_on_preempt_none_leaves_the_signal_to_python(tmp_path: Path) -> None:
    """No handler is installed: SIGUSR1 ends the process as Python's default does (checked in a child)."""
    done = _in_a_child(
        "_learner, _fit, SignalAt",
        f"_fit(_learner({str(tmp_path)!r}, on_preempt=None, cbs=[SignalAt(2, 'step', signal.SIGUSR1)]))",
    )
    assert done.returncode == -signal.SIGUSR1, done.stderr[-2000:]


def fit_with_a_slow_save_signalled(path: str, seconds: float) -> None:
    """Fit where the first checkpoint write gets SIGTERM as it begins and then takes `seconds`
    (a slow disk), longer than the stall limit."""
    import time

    real_save = checkpoint_store.atomic_save

    def slow_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(seconds)
        return real_save(*args, **kwargs)

    checkpoint_store.atomic_save = slow_save
    _fit(_learner(Path(path)))


@pytest.mark.procs  # a fresh interpreter: about 10 s
def test_a_checkpoint_write_longer_than_the_stall_limit_is_not_taken_for_a_hang(tmp_path: Path) -> None:
    """A signal that arrives while a checkpoint is being written, on a disk slow enough that the write
    outlasts the stall limit: the rank finishes it, writes the preemption checkpoint and exits 75,
    instead of being killed by the signal mid-write (which kept only the previous checkpoint).

    (A rank stuck after the signal while another rank is gone ends by the signal, and a slow one
    while all are there is waited for: tests/test_run_launch.py and tests/test_faults.py, under the
    real launcher.)"""
    from unison.callbacks.preemption import STALL_S

    done = _in_a_child(
        "fit_with_a_slow_save_signalled", f"fit_with_a_slow_save_signalled({str(tmp_path)!r}, {STALL_S + 2})"
    )
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-2000:]
    state = torch.load(tmp_path / "models" / "checkpoint.pth", weights_only=True)
    assert (state["epoch"], state["steps_done"]) == (0, 4)  # the write the signal interrupted (every=4)
    assert "preempted" in done.stderr.lower()


# ---- which signals ---------------------------------------------------------------------------------
def test_signal_names_numbers_and_the_environment() -> None:
    assert parse_signals("SIGTERM, usr1,12") == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    for bad, said in (("SIGFOO", "unknown signal 'SIGFOO'"), ("SIGKILL", "SIGKILL cannot be handled")):
        with pytest.raises(ValueError, match=said):
            parse_signals(bad)
    assert preempt_signals({}) == (signal.SIGTERM, signal.SIGUSR1)
    elastic = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    assert preempt_signals(elastic) == (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    assert preempt_signals({**elastic, "UNISON_PREEMPT_SIGNALS": "SIGUSR2"}) == (signal.SIGUSR2,)
    assert launcher_signals(None, {}) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert launcher_signals(None, {"TORCHELASTIC_SIGNALS_TO_HANDLE": "term,usr2"}) == "SIGTERM,SIGUSR2"
    assert launcher_signals("SIGUSR1", {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}) == "SIGUSR1"
    assert Preemption("SIGUSR2").signals == (signal.SIGUSR2,)
    with pytest.raises(ValueError, match="on_preempt must be 'stop', 'requeue' or None"):
        _learner(Path("."), on_preempt="later")


# ---- SLURM's requeue ---------------------------------------------------------------------------------
def _fake_scontrol(folder: Path, checkpoint: Path | None = None) -> Path:
    """A `scontrol` that records its arguments (and whether `checkpoint` exists when it is called)."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "calls"
    seen = f'; test -f {checkpoint} && echo "checkpoint there" >> {log}' if checkpoint else ""
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}{seen}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return log


def test_requeue_calls_scontrol_with_the_job_or_array_task(tmp_path: Path) -> None:
    log = _fake_scontrol(tmp_path / "bin")
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    assert requeue({"SLURM_JOB_ID": "4242", "PATH": path}) == "job 4242 requeued (scontrol requeue 4242)"
    array = {"SLURM_JOB_ID": "1207", "SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "7", "PATH": path}
    assert job_to_requeue(array) == "1200_7"
    assert requeue(array) == "job 1200_7 requeued (scontrol requeue 1200_7)"
    assert log.read_text().splitlines() == ["requeue 4242", "requeue 1200_7"]


def test_requeue_without_scontrol_or_slurm_is_one_clear_line(tmp_path: Path) -> None:
    said = requeue({"SLURM_JOB_ID": "4242", "PATH": str(tmp_path)})  # nothing on PATH
    assert said.startswith("requeue asked, but scontrol is not on PATH (a container without SLURM's tools?)")
    assert "job 4242 was not requeued" in said
    assert requeue({"PATH": os.environ["PATH"]}).startswith("requeue asked, but this is not a SLURM job")
    failing = tmp_path / "bin" / "scontrol"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\necho 'Requested operation is presently disabled' >&2\nexit 1\n")
    failing.chmod(0o755)
    said = requeue({"SLURM_JOB_ID": "9", "PATH": str(failing.parent)})
    assert said.startswith("scontrol requeue 9 failed (Requested operation is presently disabled)")


def test_a_scontrol_ended_by_the_requeues_own_sigterm_is_not_called_a_failure(tmp_path: Path) -> None:
    """SLURM's requeue kills the job's processes, scontrol among them when it has not exited yet (seen
    under load: "scontrol requeue 20677 failed (exit status -15): resubmit the job", for a job SLURM
    had requeued: a user following it would run the job twice)."""
    killed = tmp_path / "bin" / "scontrol"
    killed.parent.mkdir()
    killed.write_text("#!/bin/sh\nkill -TERM $$\n")
    killed.chmod(0o755)
    said = requeue({"SLURM_JOB_ID": "20677", "PATH": str(killed.parent)})
    assert said.startswith("job 20677 requeue asked (scontrol requeue 20677)"), said
    assert "failed" not in said and "resubmit" not in said
    assert "sacct -j 20677" in said  # how to confirm it


def test_on_preempt_requeue_requeues_once_the_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "run" / "models" / "checkpoint.pth"
    log = _fake_scontrol(tmp_path / "bin", checkpoint)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    learn = _learner(tmp_path / "run", every=100, cbs=[SignalAt(1, "step")], on_preempt="requeue")
    with pytest.raises(Preempted) as stopped:
        _fit(learn)
    assert log.read_text().splitlines() == ["requeue 31", "checkpoint there"]
    assert str(stopped.value).endswith("; job 31 requeued (scontrol requeue 31)")
    # "stop" requeues only when the batch script asks for it (UNISON_REQUEUE=1)
    monkeypatch.setenv("UNISON_REQUEUE", "1")
    learn = _learner(tmp_path / "run2", every=100, cbs=[SignalAt(1, "step")])
    with pytest.raises(Preempted):
        _fit(learn)
    assert log.read_text().splitlines().count("requeue 31") == 2

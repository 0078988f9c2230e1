"""Preemption of a real 2-process `unison launch` job (issue 22, item 2).

A signal reaches the job at a chosen or a random moment: sent to the launcher as a scheduler does
(the launcher forwards it to every worker), or to one worker only. Every rank stops at one step
boundary, the checkpoint is written there, the launcher ends with 75 ("preempted, resume me")
within its shutdown grace and restarts nothing; the job run again resumes and ends on the weights
of an uninterrupted run (sha256 of every rank's weights).

Three moments run in the suite (a validation batch with SIGUSR1; a checkpoint write, the signal
reaching rank 0 alone, under --max-restarts 1; SIGTERM from outside at a random time).
`UNISON_PREEMPT_RUNS=10` adds random ones (`UNISON_PREEMPT_SEED` picks them), as run for docs/faults.md.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.hangs import communicate_or_report
from tests.launch.test_cluster_faults import leftovers, no_process_survives, weights  # noqa: F401
from tests.launch.test_launch import LAUNCH, ROOT
from unison.launch.launcher import SHUTDOWN_GRACE_S, parse_options
from unison.launch.options import LaunchError

SCRIPT = str(ROOT / "tests" / "fault_scripts" / "preemptible.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WAIT_S = 150  # bound on any one launch
STEPS = 12  # 3 epochs of 4 steps (64 items, batch 8 on each of 2 processes)


def run(folder: Path, *script_args: str, launch_args=(), signal_launcher_at=None):
    """One launch of preemptible.py; with `signal_launcher_at=(sig, delay)`, the test sends `sig` to
    the launcher `delay` s after the job wrote `ready`. Returns (rc, out, err, seconds from the
    signal to the launcher's end or None)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [*LAUNCH, "--nproc", "2", *launch_args, SCRIPT, "--dir", str(folder), *script_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = None
    if signal_launcher_at is not None:
        sig, delay = signal_launcher_at
        deadline = time.monotonic() + WAIT_S
        while not (folder / "ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
            sent = time.time()
    out, err = communicate_or_report(proc, WAIT_S, "the launch")
    ended = time.time()
    if sent is None and (folder / "sent").exists():
        sent = (folder / "sent").stat().st_mtime
    return proc.returncode, out, err, (ended - sent if sent is not None else None)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    rc, out, err, _ = run(tmp_path_factory.mktemp("whole"))
    assert rc == 0, err[-3000:]
    (digest,) = weights(out)
    return digest


def moments() -> list[tuple[str, str, int, str, float, int]]:
    """(phase, to, rank, signal, delay, step): the suite's three, then random ones up to
    UNISON_PREEMPT_RUNS; UNISON_PREEMPT_SEED makes every draw (steps and delays too) repeatable."""
    rng = random.Random(int(os.environ.get("UNISON_PREEMPT_SEED", time.time_ns() % 10_000)))
    chosen = [
        ("validate", "launcher", 0, "SIGUSR1", 0.0),
        ("save", "self", 0, "SIGTERM", 0.0),  # rank 0 alone: it writes the checkpoint; rank 1 agrees
        ("outside", "launcher", 0, "SIGTERM", rng.uniform(0.0, 1.0)),
    ]
    while len(chosen) < int(os.environ.get("UNISON_PREEMPT_RUNS", "3")):
        phase = rng.choice(["step", "validate", "save", "outside"])
        to = "launcher" if phase == "outside" else rng.choice(["launcher", "self"])
        rank = 0 if phase == "save" or to == "launcher" else rng.choice([0, 1])
        chosen.append((phase, to, rank, rng.choice(["SIGTERM", "SIGUSR1"]), rng.uniform(0.0, 1.5)))
    # the cue's step ("validate" and "save" act at or after it)
    return [(*moment, rng.randint(1, STEPS - 4)) for moment in chosen]


@pytest.mark.launch
@pytest.mark.timeout(int(os.environ.get("UNISON_PREEMPT_RUNS", "3")) * 2 * WAIT_S)  # each launch is bounded
def test_a_signal_at_random_moments_ends_75_in_the_grace_and_resumes_to_the_same_weights(
    tmp_path: Path, uninterrupted: str
) -> None:
    for i, (phase, to, rank, signame, delay, at) in enumerate(moments()):
        if phase == "outside":
            # The signal must land in training: 8 steps of 0.3 s or more after `ready`, against a delay
            # of at most 1.5 s (seen under load with 4 steps of 0.2 s left and a delay of 0.88 s:
            # training had ended, and the launcher's SIGTERM stopped the finished job with 143).
            at = min(at, STEPS - 8)
        folder = tmp_path / f"run{i}"
        what = f"run {i}: {signame} to the {to} (rank {rank}) at {phase}, step {at}, delay {delay:.2f}"
        print(what)
        restarts = ["--max-restarts", "1"] if to == "self" else []
        if phase == "outside":
            args = ["--phase", "ready", "--at", str(at), "--step-s", "0.3"]
            rc, _, err, took = run(folder, *args, signal_launcher_at=(getattr(signal, signame), delay))
        else:
            args = ["--phase", phase, "--at", str(at), "--to", to, "--rank", str(rank), "--signal", signame]
            rc, _, err, took = run(folder, *args, launch_args=restarts)
        assert rc == 75, f"{what}\n{err[-3000:]}"
        how = f"{signame} reached the launcher and its workers" if to == "launcher" else "a signal reached"
        assert f"unison launch: preempted ({how}" in err, f"{what}\n{err[-3000:]}"
        assert f"[rank0] unison: preempted by {signame}: every rank stopped " in err, err[-3000:]
        assert "restarting" not in err and "Traceback" not in err, f"{what}\n{err[-3000:]}"
        assert took is not None and took < SHUTDOWN_GRACE_S, (what, took)
        print(f"  seconds from the signal to the launcher's end: {took:.1f}")
        rc, out, err, _ = run(folder)  # the job, resubmitted
        assert rc == 0, f"{what}\n{err[-3000:]}"
        assert weights(out) == {uninterrupted}, what
        assert leftovers(str(folder)) == []


def test_signals_to_handle_default_env_and_bad_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR1 (`sbatch --signal=USR1@90`) is forwarded by default (torch's agent would die of it);
    TORCHELASTIC_SIGNALS_TO_HANDLE and PET_SIGNALS_TO_HANDLE set the list, the option wins; an
    unknown name is refused in one line before anything starts."""
    script = tmp_path / "train.py"
    script.write_text("")
    for name in ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PET_SIGNALS_TO_HANDLE"):
        monkeypatch.delenv(name, raising=False)

    def handled(*argv: str) -> str:
        return parse_options([*argv, str(script)]).torchrun.agent["signals_to_handle"]

    assert handled() == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert handled("--signals-to-handle", "term,usr2") == "SIGTERM,SIGUSR2"
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR2")
    assert handled() == "SIGTERM,SIGUSR2"
    assert handled("--signals_to_handle=SIGUSR1") == "SIGUSR1"
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGHUP")  # Kubeflow's PyTorchJob way of giving it
    assert handled() == "SIGHUP"
    with pytest.raises(LaunchError, match=r"--signals-to-handle: unknown signal 'SIGFOO'"):
        handled("--signals-to-handle", "SIGTERM,SIGFOO")

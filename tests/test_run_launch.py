"""`unison.Run` under the real launcher: a SIGKILLed rank resumes mid-epoch to the weights of the plain
one-process loop written here, a SIGTERM checkpoints and exits 75 and the resumed job ends there too,
and `unison check-exact` works on an own loop."""

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.hangs import communicate_or_report, run_or_report

pytestmark = pytest.mark.launch  # real processes: launches, kills

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "fault_scripts" / "own_loop.py"
TOL = 1e-9  # float64 rounding, amplified by AdamW (see tests/test_run.py)


def plain_loop(sched: bool = False) -> dict[str, torch.Tensor]:
    """What tests/fault_scripts/own_loop.py trains, in one process without unison (global batch 16);
    `sched`: with its OneCycleLR (`--sched`), stepped after each step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=12) if sched else None
    for _ in range(2):
        for b in range(math.ceil(96 / 16)):
            xb, yb = x[b * 16 : (b + 1) * 16], y[b * 16 : (b + 1) * 16]
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return model.state_dict()


def launch(
    tmp_path: Path, launch_args: tuple[str, ...], *script_args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", *launch_args, str(SCRIPT)]
    cmd += ["--dir", str(tmp_path), *script_args]
    return run_or_report(cmd, timeout)


def final_diff(tmp_path: Path, sched: bool = False) -> float:
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    expected = plain_loop(sched)
    return max(float((got[k] - expected[k]).abs().max()) for k in expected)


@pytest.mark.parametrize("sched", [False, True], ids=["plain", "one-cycle-scheduler"])
def test_a_sigkilled_rank_resumes_mid_epoch_to_the_plain_loops_weights(tmp_path: Path, sched: bool) -> None:
    extra = ("--sched",) if sched else ()
    proc = launch(tmp_path, ("--max-restarts", "1"), "--bs", "8", "--kill-rank", "1", "--at", "4", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart" in proc.stderr.lower()  # it did die and come back
    assert final_diff(tmp_path, sched) < TOL


def test_sigterm_checkpoints_exits_75_and_the_resumed_job_ends_on_the_same_weights(tmp_path: Path) -> None:
    """Rank 0 is healthy but slow after the signal (it finishes its step STALL_S + 2 s later): it is
    not taken for a hung rank and killed (exit 143, no checkpoint). The message names the own loop's
    resume, and the resumed job's OneCycleLR (given to run.setup) continues where it stopped."""
    from unison.callbacks.preemption import STALL_S

    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SCRIPT), "--dir", str(tmp_path)]
    cmd += ["--bs", "8", "--wait-at", "3", "--slow-after-signal", str(STALL_S + 2), "--sched"]
    # A 40 s grace, not the launcher's 20: rank 0 alone spends STALL_S + 2 s of it asleep, and on a
    # loaded machine (load 6.5, a full parallel run) two workers writing and exiting took the rest.
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "40"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "waiting").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the script never reached step 3"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = communicate_or_report(proc, 120)
    # All of it: once in a quiet full run (2026-11-27) rank 0 ended while rank 1 was writing the
    # checkpoint (exit 143); the last 3,000 characters showed only rank 1's side.
    assert proc.returncode == 75, err[-30000:]
    # at the step boundary where the ranks next compare notes (about every 0.5 s), or the epoch's end
    stopped = r"preempted by SIGTERM: every rank stopped (in epoch \d, after step \d|at the end of epoch \d)"
    assert re.search(
        stopped + r"; checkpoint written to .*: resubmit with run\.epochs\(n, resume=True\)", err
    ), err
    assert not (tmp_path / "final.pt").exists()
    (tmp_path / "waiting").unlink()
    again = launch(tmp_path, (), "--bs", "8", "--sched")  # its OneCycleLR continues from the checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    assert final_diff(tmp_path, sched=True) < TOL


def test_the_uninterrupted_one_process_run_is_the_plain_loop(tmp_path: Path) -> None:
    proc = run_or_report(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--bs", "16"], 120, env={**os.environ}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_diff(tmp_path) < TOL


@pytest.mark.timeout(200)
def test_a_hanging_rank_fails_the_job_within_the_timeout_naming_it(tmp_path: Path) -> None:
    # --timeout 10: a healthy first collective can outlast 5 s on a loaded machine. The bound counts
    # from the moment rank 1 hung (the script writes it), not from the start-up.
    proc = launch(tmp_path, ("--timeout", "10"), "--bs", "8", "--hang-rank", "1", "--at", "3", timeout=150)
    ended = time.time()
    assert proc.returncode != 0
    assert ended - float((tmp_path / "hung_at").read_text()) < 10 + 60
    assert "rank 1 stopped taking part" in proc.stderr, proc.stderr[-3000:]
    # The hung rank, which torch's agent stopped with SIGTERM when rank 0 failed, ended by that signal
    # (Preemption's stall watch: another rank is gone), not by the SIGKILL after the launcher's grace.
    assert "1 (signal SIGTERM)" in proc.stderr, proc.stderr[-3000:]

"""What `unison launch` reads into a failure (unison.launch.failures): which errors a restart meets
again, the OOM killer's count of the worker's own memory cgroup, the restart line's place."""

from __future__ import annotations

import subprocess
import sys

import pytest

from unison.launch.failures import deterministic_failure


@pytest.mark.parametrize(
    "headline,why",
    [
        ("OSError: [Errno 30] Read-only file system: '/ckpt/models'", "read-only file system (errno 30)"),
        (
            "PermissionError: [Errno 13] Permission denied: '/ckpt/models/checkpoint.pth'",
            "permission denied (errno 13)",
        ),
        ("CheckpointError: /ckpt/models/checkpoint.pth is damaged or truncated", "CheckpointError"),
        ("unison.checkpoint.errors.CheckpointError: the checkpoint holds another model", "CheckpointError"),
        ("DiskFullError: disk full (ENOSPC; OSError: [Errno 28] No space left on device)", "DiskFullError"),
        ("NonFiniteError: non-finite loss (nan) at epoch 0, step 3", "NonFiniteError"),
        ("ModuleNotFoundError: No module named 'trainlib'", "ModuleNotFoundError"),
        ("OSError: [Errno 28] No space left on device", "no space left (errno 28)"),
    ],
)
def test_errors_a_restart_meets_again_are_named(headline, why):
    assert deterministic_failure(headline) == why


@pytest.mark.parametrize(
    "headline",
    [
        "RuntimeError: Connection reset by peer",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "RankStalledError: rank 1 stopped taking part: no heartbeat for 10 s",
        "ValueError: a CheckpointError-free message",
        "",
    ],
)
def test_errors_a_restart_may_get_past_are_not(headline):
    assert deterministic_failure(headline) is None


# A worker whose first attempt dies in the middle of a line of stderr (a traceback cut off by a kill).
CUT_OFF = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.stderr.write("    learn.fit(3)")  # no end of line: the process dies here
    sys.stderr.flush()
    os._exit(3)
print("second attempt ran", flush=True)
"""


@pytest.mark.slow  # a real launch and restart
def test_the_restart_line_starts_on_a_line_of_its_own(tmp_path):
    """The launcher's lines came glued to a rank's cut-off last line:
    `[rank0]:    learn.fit(3)unison launch: restarting the workers (restart 1 of 1): ...`."""
    script = tmp_path / "cut.py"
    script.write_text(CUT_OFF)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "1", "--max-restarts", "1", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "second attempt ran" in proc.stdout
    lines = proc.stderr.splitlines()
    cut = [line for line in lines if "learn.fit(3)" in line]
    assert cut and all(line.endswith("learn.fit(3)") for line in cut), proc.stderr[-3000:]
    assert any(line.startswith("unison launch: restarting the workers (restart 1 of 1)") for line in lines), (
        proc.stderr[-3000:]
    )


@pytest.mark.slow
def test_the_failure_summary_starts_on_a_line_of_its_own(tmp_path):
    """The same cut-off line with no restart: the summary after it starts a line too."""
    script = tmp_path / "cut.py"
    script.write_text(CUT_OFF)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "1", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert any(line.endswith("learn.fit(3)") for line in lines), proc.stderr[-3000:]
    assert any(line.startswith("unison launch: rank 0 failed (exit code 3)") for line in lines), proc.stderr[
        -3000:
    ]

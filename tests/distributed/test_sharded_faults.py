"""Faults in a sharded job, real launches: a killed rank restarts exactly, a stalled one is named."""

import re
import sys
import time
from pathlib import Path

import pytest

from tests.hangs import run_or_report

pytestmark = pytest.mark.launch  # real processes: launches, kills

SCRIPT = Path(__file__).resolve().parents[1] / "fault_scripts" / "sharded_resumable.py"


def launch(folder, *launch_args, script_args=(), timeout=180):
    cmd = [
        sys.executable,
        "-m",
        "unison.launch",
        "--nproc",
        "2",
        *launch_args,
        str(SCRIPT),
        "--dir",
        str(folder),
    ]
    start = time.monotonic()
    proc = run_or_report([*cmd, *script_args], timeout)
    return proc, time.monotonic() - start


def digests(proc):
    return dict(re.findall(r"WEIGHTS (rank\d) ([0-9a-f]{64})", proc.stdout))


def test_a_killed_rank_restarts_and_ends_on_the_uninterrupted_weights(pool2, tmp_path):
    from tests.fault_scripts.sharded_resumable import train

    expected = pool2.run(train, tmp_path / "clean")  # the same job, uninterrupted, on the test's pool
    assert len(set(expected)) == 1
    args = ["--kill-rank", "1", "--at", "5"]
    killed, _ = launch(tmp_path / "killed", "--max-restarts", "1", script_args=args)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert re.search(r"restart|SIGKILL|Signals", killed.stderr, re.IGNORECASE), killed.stderr[-3000:]
    # Bit for bit, resumed from the sharded checkpoint; the launcher shows every rank's stdout.
    assert digests(killed) == {"rank0": expected[0], "rank1": expected[0]}


@pytest.mark.timeout(200)
def test_a_stalled_rank_is_named_within_the_timeout(tmp_path):
    # --timeout 10: a healthy first collective can outlast 5 s on a loaded machine. The bound counts
    # from the moment rank 1 hung (the script writes it), not from the start-up.
    proc, _ = launch(tmp_path, "--timeout", "10", script_args=["--hang-rank", "1", "--at", "3"], timeout=150)
    ended = time.time()
    assert proc.returncode != 0
    hung_for = ended - float((tmp_path / "hung_at").read_text())
    assert hung_for < 10 * 3 + 30  # the failed collective, the failed gather back, the shutdown
    assert "rank 1 stopped taking part" in proc.stderr, proc.stderr[-3000:]

"""A rank that hangs, through the real launcher (killed workers and restarts: test_launch, test_multinode)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_scripts import disks
from tests.hangs import run_or_report

pytestmark = pytest.mark.launch  # real processes: launches, spawns, kills

SCRIPT = Path(__file__).parent / "fault_scripts" / "resumable.py"


def launch(tmp_path, *launch_args, script_args=(), timeout=120, nproc=2):
    cmd = [
        sys.executable,
        "-m",
        "unison.launch",
        "--nproc",
        str(nproc),
        *launch_args,
        str(SCRIPT),
        "--dir",
        str(tmp_path),
        *script_args,
    ]
    start = time.monotonic()
    # fresh: `leftover_workers` finds a worker the launcher failed to stop by its command line, the
    # launcher's own (a zygote's fork), which a warm launch does not have (tests/warm_runner.py)
    proc = run_or_report(cmd, timeout, fresh=True)
    return proc, time.monotonic() - start


def leftover_workers(marker, kill=False):
    """Processes still running our script (a worker the launcher failed to stop); SIGKILLed if `kill`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                found.append(cmdline)
                if kill:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
    return found


def test_a_hanging_rank_fails_the_job_within_the_timeout_naming_it(tmp_path):
    # --timeout 10: a healthy first collective can outlast 5 s on a loaded machine. The bound counts
    # from the moment rank 1 hung (the script writes it), not from the start-up.
    proc, _ = launch(tmp_path, "--timeout", "10", script_args=["--hang-rank", "1", "--at", "3"], timeout=110)
    ended = time.time()
    assert proc.returncode != 0
    assert ended - float((tmp_path / "hung_at").read_text()) < 10 + 30
    assert "rank 1 stopped taking part" in proc.stderr, proc.stderr[-3000:]
    # The hung rank, which torch's agent stopped with SIGTERM when rank 0 failed, ended by that signal
    # (Preemption's stall watch: another rank is gone), not by the SIGKILL after the launcher's grace.
    assert "1 (signal SIGTERM)" in proc.stderr, proc.stderr[-3000:]
    assert leftover_workers(str(tmp_path)) == []


# The whole matrix (2 processes: ranks 0, 1; 3 processes: ranks 0, 1, 2) passes, each job ending
# 9-10 s after the freeze on 2 loaded cores; the suite keeps rank 0 (which used to host the store)
# and the last rank.
@pytest.mark.parametrize("nproc,frozen", [(2, 0), (3, 2)])
def test_a_frozen_rank_fails_the_job_within_timeout_plus_30s_naming_it(tmp_path, nproc, frozen):
    try:
        proc, _ = launch(
            tmp_path,
            "--timeout",
            "10",  # 5 s: a healthy first collective outlasted it on a loaded machine
            nproc=nproc,
            script_args=["--freeze-rank", str(frozen), "--at", "3"],
            timeout=120,
        )
        ended = time.time()
        assert proc.returncode != 0
        assert f"rank {frozen} stopped taking part" in proc.stderr, proc.stderr[-3000:]
        assert "frozen" in proc.stderr
        frozen_for = ended - float((tmp_path / "frozen_at").read_text())
        assert frozen_for < 10 + 30, frozen_for  # from the freeze, not from the start (imports under load)
        assert leftover_workers(str(tmp_path)) == []
    finally:
        leftover_workers(str(tmp_path), kill=True)


def test_a_single_machine_job_listens_on_loopback_only(tmp_path):
    if subprocess.run(["which", "ss"], capture_output=True).returncode != 0:
        import pytest

        pytest.skip("needs ss (iproute2) to list listening sockets")
    script = Path(__file__).parent / "fault_scripts" / "listeners.py"
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--all-ranks-stdout", str(script)]
    proc = run_or_report(cmd, 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    addresses = [line.split()[-1] for line in proc.stdout.splitlines() if "LISTEN rank" in line]
    assert addresses  # the store and gloo's sockets at least
    assert all(a.startswith(("127.0.0.1:", "[::1]:")) for a in addresses), addresses


def test_a_full_disk_stops_the_job_naming_it_and_does_not_restart_into_it(tmp_path):
    with disks.small_disk(tmp_path / "disk", size="256k") as disk:
        disks.fill(disk, 4096)
        proc, _ = launch(disk, "--max-restarts", "2", timeout=120)
    assert proc.returncode != 0
    assert (
        "disk full (ENOSPC; OSError: [Errno 28] No space left on device" in proc.stderr
        and "checkpoint.pth" in proc.stderr
    ), proc.stderr[-3000:]
    assert "not restarting" in proc.stderr
    assert "restarting the workers" not in proc.stderr
    assert leftover_workers(str(tmp_path)) == []


def test_a_read_only_checkpoint_folder_is_not_restarted_into(tmp_path):
    """`OSError: [Errno 30]` will happen again after a restart: --max-restarts 2 used to spend both
    restarts on it (three attempts, each failing at its first checkpoint)."""
    with disks.read_only(tmp_path / "ro") as folder:
        proc, _ = launch(folder, "--max-restarts", "2", timeout=120)
    assert proc.returncode != 0
    assert "[Errno 30] Read-only file system" in proc.stderr, proc.stderr[-3000:]
    assert "not restarting: rank " in proc.stderr, proc.stderr[-3000:]
    assert "restarting the workers" not in proc.stderr
    assert leftover_workers(str(tmp_path)) == []


def test_a_refused_checkpoint_is_not_restarted_into(tmp_path):
    """A damaged checkpoint is refused (`CheckpointError`) at every resume: no restart is spent on it."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "checkpoint.pth").write_bytes(b"not a checkpoint")
    proc, _ = launch(tmp_path, "--max-restarts", "2", timeout=120)
    assert proc.returncode != 0
    assert "CheckpointError: " in proc.stderr and "damaged or truncated" in proc.stderr, proc.stderr[-3000:]
    assert "not restarting: rank " in proc.stderr, proc.stderr[-3000:]
    assert "restarting the workers" not in proc.stderr
    assert (tmp_path / "models" / "checkpoint.pth").read_bytes() == b"not a checkpoint"  # left as it was
    assert leftover_workers(str(tmp_path)) == []


@pytest.mark.parametrize("restarts,written", [(1, ""), (0, '{"message": {"mess')])
def test_a_rank_killed_while_writing_its_error_file_is_restarted_and_named(tmp_path, restarts, written):
    """torch's agent reads a failed rank's error file with json.load: an empty or torn one (the rank
    was stopped while writing it, as torch's @record writes it) ended the job with `JSONDecodeError`,
    no restart and no rank named. The worker's error file reaches the agent whole or not at all."""
    proc, _ = launch(
        tmp_path,
        "--max-restarts",
        str(restarts),
        script_args=["--torn-rank", "1", "--torn", written, "--at", "3"],
    )
    assert "JSONDecodeError" not in proc.stderr, proc.stderr[-3000:]
    if restarts:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "restarting the workers (restart 1 of 1)" in proc.stderr
        weights = sorted(line.split()[-1] for line in proc.stdout.splitlines() if "WEIGHTS" in line)
        assert len(weights) == 2 and weights[0] == weights[1]
    else:
        assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
        assert "rank 1 failed (signal SIGKILL)" in proc.stderr, proc.stderr[-3000:]
    assert leftover_workers(str(tmp_path)) == []


def test_a_program_leaving_a_torn_error_file_is_named(tmp_path):
    """A `--no-python` program writes its error file itself: a torn one stops torch's agent, and
    the launcher names the rank and keeps its logs instead of printing a bare JSONDecodeError."""
    program = tmp_path / "job.sh"
    program.write_text(
        "#!/bin/sh\n"
        'if [ "$RANK" = 1 ]; then printf \'{"mess\' > "$TORCHELASTIC_ERROR_FILE"; exit 3; fi\n'
        "exec sleep 60\n"
    )
    program.chmod(0o700)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", "--log-dir", str(tmp_path / "logs")]
    proc = run_or_report([*cmd, "--no-python", str(program)], 60)
    assert proc.returncode == 1
    assert "rank 1 failed and left an empty or torn error file" in proc.stderr, proc.stderr[-3000:]
    assert "JSONDecodeError" not in proc.stderr
    assert leftover_workers(str(program)) == []


def test_a_rank_that_exits_early_is_named_as_such_not_as_stuck(tmp_path):
    """Rank 1's script exits (status 0) mid-epoch: rank 0's next collective fails at once, and the
    diagnosis says rank 1 left early; it used to say "stuck ... (its Python stacks are dumped to its
    stderr)", and no stacks exist."""
    proc, elapsed = launch(
        tmp_path, "--timeout", "20", script_args=["--exit-rank", "1", "--at", "3"], timeout=90
    )
    assert proc.returncode != 0
    assert "rank 1 left the training early at epoch 0 training batch" in proc.stderr, proc.stderr[-3000:]
    assert "stuck" not in proc.stderr and "stacks" not in proc.stderr, proc.stderr[-3000:]
    assert leftover_workers(str(tmp_path)) == []

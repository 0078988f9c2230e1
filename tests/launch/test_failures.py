"""What `unison launch` reads into a failure (unison.launch.failures): which errors a restart meets
again, the OOM killer's count of the worker's own memory cgroup, the restart line's place."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hangs import communicate_or_report, run_or_report, wait_for_file
from unison.launch.failures import deterministic_failure, exit_phrase, oom_count, sigkill_cause


@contextlib.contextmanager
def memory_cgroup(limit: int, inside_own: bool = True) -> Iterator[Path]:
    """A memory cgroup of at most `limit` bytes: inside this process's own memory cgroup (a process of
    this job), or beside it at the top (another job's); skip where none can be made (root, v1 or v2)."""
    own = {
        c: p.lstrip("/")
        for _, c, p in (x.split(":", 2) for x in Path("/proc/self/cgroup").read_text().split())
    }
    v1 = next((p for c, p in own.items() if "memory" in c.split(",")), None)
    if Path("/sys/fs/cgroup/memory").is_dir() and v1 is not None:
        parent, limit_file = (
            Path("/sys/fs/cgroup/memory") / (v1 if inside_own else ""),
            "memory.limit_in_bytes",
        )
    else:
        parent, limit_file = Path("/sys/fs/cgroup") / (own.get("", "") if inside_own else ""), "memory.max"
        if "memory" not in (parent / "cgroup.subtree_control").read_text() if parent.is_dir() else True:
            pytest.skip("no memory cgroup controller to make a cgroup with here")
    path = parent / f"unison-oom-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / limit_file).write_text(str(limit))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc}); it needs root")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 30
        while path.exists():  # removable once its processes are gone
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


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


@pytest.mark.launch  # a real launch and restart
def test_the_restart_line_starts_on_a_line_of_its_own(tmp_path):
    """The launcher's lines came glued to a rank's cut-off last line:
    `[rank0]:    learn.fit(3)unison launch: restarting the workers (restart 1 of 1): ...`."""
    script = tmp_path / "cut.py"
    script.write_text(CUT_OFF)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "1", "--max-restarts", "1", str(script)]
    proc = run_or_report(cmd, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "second attempt ran" in proc.stdout
    lines = proc.stderr.splitlines()
    cut = [line for line in lines if "learn.fit(3)" in line]
    assert cut and all(line.endswith("learn.fit(3)") for line in cut), proc.stderr[-3000:]
    assert any(line.startswith("unison launch: restarting the workers (restart 1 of 1)") for line in lines), (
        proc.stderr[-3000:]
    )


@pytest.mark.launch
def test_the_failure_summary_starts_on_a_line_of_its_own(tmp_path):
    """The same cut-off line with no restart: the summary after it starts a line too."""
    script = tmp_path / "cut.py"
    script.write_text(CUT_OFF)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "1", str(script)]
    proc = run_or_report(cmd, 120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert any(line.endswith("learn.fit(3)") for line in lines), proc.stderr[-3000:]
    assert any(line.startswith("unison launch: rank 0 failed (exit code 3)") for line in lines), proc.stderr[
        -3000:
    ]


# ---- the OOM killer's count: this job's own memory cgroup, else "possibly" ------------------------
def _run_out_of_memory(group: Path) -> int:
    """Start a process inside the memory cgroup `group` that allocates past its limit; its status."""
    move = f"echo $$ > {group / 'cgroup.procs'} && exec {sys.executable} -c 'b = bytearray(400_000_000)'"
    return subprocess.run(["sh", "-c", move], capture_output=True, timeout=60).returncode


@pytest.mark.procs  # a process OOM-killed in a cgroup
def test_the_oom_count_is_read_in_this_jobs_own_memory_cgroup():
    """A process of this job (in a cgroup below this process's own) OOM-killed: the count read for
    this process rises by one, from its own cgroup's file, and the cause is named without doubt."""
    before = oom_count()
    if before is None or not before.own_cgroup:
        pytest.skip(f"this process has no memory cgroup of its own here ({before})")
    with memory_cgroup(100_000_000) as group:  # (under cgroup v1 its count goes with it: read inside)
        assert _run_out_of_memory(group) == -9  # SIGKILL
        after = oom_count()
        assert after.own_cgroup and after.source == before.source and after.kills == before.kills + 1
        assert sigkill_cause(before).startswith(
            "killed by the kernel's OOM killer (out of memory): it ended 1 process(es) in this job's memory"
        )


@pytest.mark.procs  # a process OOM-killed in a cgroup
def test_without_a_cgroup_of_its_own_the_machines_count_only_says_possibly(tmp_path):
    """Where the job has no memory cgroup to read (`root` names an empty folder: no cgroup files),
    the machine's count (/proc/vmstat) rises for any job's OOM kill: the cause is only possible."""
    before = oom_count(root=tmp_path)
    if before is None:
        pytest.skip("no /proc/vmstat oom_kill count here")
    assert before.source == "/proc/vmstat" and not before.own_cgroup
    assert not sigkill_cause(before, root=tmp_path).startswith(("killed", "possibly"))  # none yet
    with memory_cgroup(100_000_000, inside_own=False) as other_job:
        assert _run_out_of_memory(other_job) == -9
    # The machine's count: other tests running beside this one (xdist) may OOM-kill processes too.
    said = re.match(
        r"possibly killed by the kernel's OOM killer \(out of memory\): it ended (\d+) process\(es\) on "
        r"this machine",
        sigkill_cause(before, root=tmp_path),
    )
    assert said is not None and int(said.group(1)) >= 1, sigkill_cause(before, root=tmp_path)
    assert exit_phrase(-9, before) == "signal SIGKILL"  # the default root: this job's cgroup, no kill in it


# Rank 0 says it is ready, waits for the test's cue, then is killed with SIGKILL (kill -9).
KILLED = """
import os, signal, sys, time
folder = sys.argv[1]
open(os.path.join(folder, "ready"), "w").close()
deadline = time.monotonic() + 100
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.launch  # a real launch
def test_another_jobs_oom_kill_is_not_blamed_for_a_kill_9(tmp_path):
    """On a shared machine another job's process is OOM-killed while this job's worker gets a plain
    `kill -9`: the launcher read the machine's /proc/vmstat count and said `killed by the kernel's
    OOM killer`; it reads its own memory cgroup's count now, and names the usual senders."""
    if (count := oom_count()) is None or not count.own_cgroup:
        pytest.skip(f"this process has no memory cgroup of its own here ({count})")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    launch = [sys.executable, "-m", "unison.launch", "--nproc", "1", str(script), str(tmp_path)]
    # The job runs in a memory cgroup of its own, as a cluster's job does: this machine's tests share
    # one, where another test's OOM kill (another xdist worker, a second copy of the suite) counts.
    with memory_cgroup(8_000_000_000) as own_job:
        cmd = ["sh", "-c", f'echo $$ > {own_job / "cgroup.procs"} && exec "$@"', "sh", *launch]
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_file(job, tmp_path / "ready", 90, "the worker did not start")
            machine = Path("/proc/vmstat").read_text()
            # another job's process, and one of another test beside this one (this session's cgroup)
            with (
                memory_cgroup(100_000_000, inside_own=False) as other_job,
                memory_cgroup(100_000_000) as beside,
            ):
                assert _run_out_of_memory(other_job) == -9
                assert _run_out_of_memory(beside) == -9
                assert Path("/proc/vmstat").read_text() != machine  # the machine's count rose
                (tmp_path / "go").touch()
                _, err = communicate_or_report(job, 90)
        finally:
            job.kill()
            job.wait()
    assert job.returncode == 137, err[-3000:]
    assert "unison launch: rank 0 failed (signal SIGKILL)" in err, err[-3000:]
    assert "OOM killer (out of memory): it ended" not in err, err[-3000:]
    assert "by kill -9, or by a scheduler's hard stop" in err, err[-3000:]


def test_a_v1_cgroup_removed_during_the_attempt_does_not_hide_an_oom_kill_in_another(tmp_path):
    """cgroup v1 counts OOM kills per cgroup, and the job's count is the sum over its tree. A cgroup
    below it that held an earlier kill and is removed during the attempt (another test's, another
    job step's) took that kill out of the sum: a new kill then left the sum where it was, and the
    rank's SIGKILL was not put down to the OOM killer (a loaded double run of the suite, 2026-11-27).
    Read from real files laid out as v1's, under a root folder given to `oom_count`."""
    own = next(
        (
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().split()
            if ":memory:" in line
        ),
        None,
    )
    if (
        own is None
        or own == "/"
        or any(
            line.startswith("0::/") and line != "0::/"
            for line in Path("/proc/self/cgroup").read_text().split()
        )
    ):
        pytest.skip("this process is not in a cgroup v1 memory cgroup of its own")
    top = tmp_path / "memory" / own.lstrip("/")

    def cgroup(name: str, kills: int) -> Path:
        folder = top / name if name else top
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
        return folder

    cgroup("", 0)
    earlier = cgroup("unison-oom-a", 1)  # a kill before this attempt, in a cgroup soon removed
    cgroup("unison-oom-b", 0)
    before = oom_count(root=tmp_path)
    assert before is not None and before.own_cgroup and before.kills == 1
    (earlier / "memory.oom_control").unlink()
    earlier.rmdir()
    cgroup("unison-oom-b", 1)  # this attempt's kill: the sum is 1 again
    assert oom_count(root=tmp_path).kills == 1
    assert sigkill_cause(before, root=tmp_path).startswith(
        "killed by the kernel's OOM killer (out of memory)"
    )
    assert "it ended 1 process(es) in this job's memory cgroup" in sigkill_cause(before, root=tmp_path)

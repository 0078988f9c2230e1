"""What a cluster does to a job, done for real to `unison launch` (issue 19, item 3).

The kernel's OOM killer (a real one: the rank is moved into a small memory cgroup and runs out of
it), a console pipe whose reader goes away, one rank's `sys.exit(0)` mid-training, SIGTERM with a
grace period (the test plays the kubelet: SIGTERM, then SIGKILL when the grace is over), and a
network link between two machines (network namespaces joined by a veth pair) cut for longer than
`--timeout` and then restored. Each job must end within a bound, naming what happened, leave no
process behind, and where restarts are allowed end on the weights of an uninterrupted run.

Every process is real (torch's agent, gloo, signals); the OOM and the network tests need root (a
memory cgroup, `ip netns`) and skip with the reason otherwise. Workers use one thread each, so a
job on two machines computes exactly what `--nproc 2` on one does (same sha256 of the weights).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.hangs import communicate_or_report
from tests.launch.shared_runs import once_per_session
from tests.launch.test_launch import LAUNCH, ROOT
from tests.launch.test_multinode import Machines, machines, netns_port  # noqa: F401  (fixture)
from unison.launch.torch_compat import TAKES_SHUTDOWN_TIMEOUT

SCRIPT = str(ROOT / "tests" / "fault_scripts" / "cluster_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread a worker: 2 machines = 1 machine, bit for bit
WAIT_S = 150  # bound on any one launch


class Job:
    """One `unison launch` of cluster_job.py writing into `folder` (its path marks every process of it)."""

    def __init__(
        self, folder: Path, *launch_args: str, script_args=(), nproc=1, prefix=(), stdout=True, env=None
    ):  # nproc None: no --nproc (the environment says it); env: more variables
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        cmd = [
            *prefix,
            *LAUNCH,
            *(["--nproc", str(nproc)] if nproc is not None else []),
            *launch_args,
            SCRIPT,
            "--dir",
            str(folder),
            *script_args,
        ]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=pipe if stdout else None, stderr=pipe, text=True
        )
        self.started = time.monotonic()
        self.out = self.err = ""

    def cue(self, limit: float = 120) -> int:
        """Wait until the cued rank reached its step; return its pid."""
        path, deadline = self.folder / "cue", time.monotonic() + limit
        while not path.exists():
            if self.proc.poll() is not None:
                self.finish()
                pytest.fail(f"the job ended before its cue (rc {self.proc.returncode}):\n{self.err[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no cue within {limit} s")
            time.sleep(0.02)
        return int(path.read_text())

    def finish(self, limit: float = WAIT_S) -> float:
        """Wait for the launcher to end (killed past `limit`); return when it ended (monotonic)."""
        self.out, self.err = communicate_or_report(self.proc, limit, "the launch")
        self.out = self.out or ""
        return time.monotonic()

    @property
    def rc(self) -> int | None:
        return self.proc.returncode


def weights(text: str) -> set[str]:
    """The weights digests the ranks printed."""
    return set(re.findall(r"WEIGHTS rank\d+ ([0-9a-f]{64})", text))


def leftovers(marker: str) -> list[str]:
    """Processes (other than this one) whose command line holds `marker`: what a job left behind."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.info["cmdline"] or [])
            if proc.info["pid"] != os.getpid() and marker in line and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.info['pid']}: {line}")
    return found


@pytest.fixture(autouse=True)
def no_process_survives(tmp_path: Path) -> Iterator[None]:
    """Whatever a test asserts, nothing it started runs on after it."""
    yield
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["pid"] != os.getpid() and str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                proc.kill()


def _run_uninterrupted(folder: Path) -> str:
    job = Job(folder, "--timeout", "10", nproc=2)
    job.finish()
    assert job.rc == 0, job.err[-3000:]
    (digest,) = weights(job.out)
    return digest


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The weights of the job run from start to end with nothing done to it (2 processes; run once per
    session: test_kubernetes reads it too)."""
    return once_per_session("uninterrupted", tmp_path_factory, _run_uninterrupted)


# ---- the kernel's OOM killer ----------------------------------------------------------------------
@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup holding at most `limit` bytes (v1 or v2), inside this process's own memory cgroup
    (a launch started here is in it: as a cluster's per-job cgroup holds every process of a job, so
    the launcher counts its OOM kills as this job's); skip the test where none can be made."""
    name = f"unison-oom-{uuid.uuid4().hex[:8]}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    own = {
        c: p.lstrip("/")
        for _, c, p in (x.split(":", 2) for x in Path("/proc/self/cgroup").read_text().split())
    }
    memory_v1 = next((p for c, p in own.items() if "memory" in c.split(",")), None)
    if v1.is_dir() and memory_v1 is not None:
        path, limit_file = v1 / memory_v1 / name, "memory.limit_in_bytes"
    elif (v2 / own.get("", "") / "cgroup.subtree_control").exists() and "memory" in (
        v2 / own.get("", "") / "cgroup.subtree_control"
    ).read_text():
        path, limit_file = v2 / own.get("", "") / name, "memory.max"
    else:
        pytest.skip("no memory cgroup controller here (a real OOM kill needs one)")
    try:
        path.mkdir()
        (path / limit_file).write_text(str(limit))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc}); a real OOM kill needs one (root)")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 30
        while path.exists():  # a cgroup is removed once its processes are gone
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def run_out_of_memory(job: Job) -> float:
    """At its cue, move the cued rank (alone: not its loader workers) into a 100 MB cgroup and let it
    allocate: the kernel's OOM killer ends it with SIGKILL. Returns when it was let go."""
    pid = job.cue()
    with memory_cgroup(100_000_000) as group:
        (group / "cgroup.procs").write_text(str(pid))
        went = time.monotonic()
        (job.folder / "go").touch()
        job.finish()
    return went


@pytest.mark.launch
def test_an_oom_killed_rank_is_named_and_its_loader_workers_go_with_it(tmp_path: Path) -> None:
    """Rank 1 (with a DataLoader worker of its own) is OOM-killed mid-epoch: the job ends with 137
    naming the rank and the OOM killer, and no process is left (its loader worker used to outlive
    the launcher by up to 5 s, until its own watchdog saw the parent gone)."""
    job = Job(
        tmp_path,
        "--timeout",
        "10",
        nproc=2,
        script_args=["--cue-rank", "1", "--cue", "oom", "--loader-workers", "1"],
    )
    went = run_out_of_memory(job)
    ended = time.monotonic() - went
    print(f"seconds from running out of memory to the launcher's end: {ended:.1f}")
    assert job.rc == 137, job.err[-3000:]
    assert "unison launch: rank 1 failed (signal SIGKILL)" in job.err, job.err[-3000:]
    assert "killed by the kernel's OOM killer (out of memory)" in job.err, job.err[-3000:]
    assert ended < 10 + 30, ended
    assert leftovers(str(tmp_path)) == []


@pytest.mark.launch
def test_an_oom_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, uninterrupted: str
) -> None:
    job = Job(
        tmp_path,
        "--timeout",
        "10",
        "--max-restarts",
        "1",
        nproc=2,
        script_args=["--cue-rank", "1", "--cue", "oom"],
    )
    went = run_out_of_memory(job)
    print(f"seconds from running out of memory to the resumed job's end: {time.monotonic() - went:.1f}")
    assert job.rc == 0, job.err[-3000:]
    restart = "unison launch: restarting the workers (restart 1 of 1): rank 1 failed (signal SIGKILL, "
    assert restart + "killed by the kernel's OOM killer" in job.err, job.err[-3000:]
    assert weights(job.out) == {uninterrupted}
    assert leftovers(str(tmp_path)) == []


# ---- the console's pipe ---------------------------------------------------------------------------
@pytest.mark.launch
def test_a_closed_stdout_pipe_keeps_the_training_and_says_where_the_output_went(
    tmp_path: Path, uninterrupted: str
) -> None:
    """The reader of the launcher's stdout goes away mid-training (`unison launch ... | head`, a log
    shipper that dies). The workers never write to that pipe (their output goes to files), so they
    train on; the launcher says once where every rank's output is kept and keeps it there (it used
    to drop the rest silently, then delete the logs), and ends 0."""
    job = Job(
        tmp_path,
        "--timeout",
        "10",
        nproc=2,
        script_args=["--cue-rank", "0", "--at", "3", "--cue", "mark", "--step-s", "0.2"],
    )
    job.cue()
    job.proc.stdout.close()  # the reader goes away
    job.proc.stdout = None
    closed = time.monotonic()
    print(f"seconds from the pipe's close to the launcher's end: {job.finish(limit=90) - closed:.1f}")
    assert job.rc == 0, job.err[-3000:]
    notes = [line for line in job.err.splitlines() if "stdout was closed" in line]
    assert len(notes) == 1, job.err[-3000:]
    kept = Path(re.search(r"output is kept in (\S+)", notes[0]).group(1))
    logs = "".join(p.read_text() for p in kept.glob("attempt_0/rank*.stdout.log"))
    assert weights(logs) == {uninterrupted}
    assert leftovers(str(tmp_path)) == []


# ---- one rank's sys.exit(0) -----------------------------------------------------------------------
@pytest.mark.launch
def test_a_rank_that_exits_0_mid_training_ends_the_job_naming_it(tmp_path: Path) -> None:
    """A torchrun-style script (its own group and DDP, no Learner): rank 1 calls sys.exit(0) mid-epoch.
    torch's agent counts exit 0 as that worker's success; rank 0's next collective fails at once on
    the closed connection, and the summary named only rank 0 ("Connection closed by peer")."""
    job = Job(
        tmp_path, "--timeout", "10", nproc=2, script_args=["--plain", "--cue-rank", "1", "--cue", "exit"]
    )
    job.cue()
    cued = time.monotonic()
    ended = job.finish() - cued
    print(f"seconds from the exit to the launcher's end: {ended:.1f}")
    assert job.rc == 1, job.err[-3000:]
    summary = job.err[job.err.index("unison launch: rank") :]
    assert summary.startswith(
        "unison launch: rank 1 left the job early (exit status 0 while the others still ran)"
    ), summary
    assert ended < 10 + 30, ended
    assert leftovers(str(tmp_path)) == []


# ---- SIGTERM, then SIGKILL when the grace period is over ----------------------------------------
GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds and SLURM's KillWait, by default


def terminate_like_a_kubelet(job: Job) -> float:
    """SIGTERM to the launcher (PID 1 of a pod); SIGKILL once the grace period is over. Returns the
    seconds from SIGTERM to the launcher's end."""
    os.kill(job.proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    try:
        job.proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        job.proc.kill()
    job.finish()
    return time.monotonic() - sent


@pytest.mark.launch
@pytest.mark.skipif(not TAKES_SHUTDOWN_TIMEOUT, reason="torch < 2.13: its agent has no shutdown grace to set")
def test_sigterm_stops_every_worker_within_the_grace_period(tmp_path: Path) -> None:
    """Two jobs at once: in one the workers stop on SIGTERM as a Learner does (every rank at one step,
    checkpointed: exit 75, "preempted"; tests/launch/test_preemption_launch.py resumes such jobs), in
    the other they note it and go on (a handler of their own, no preemption handling), so the
    launcher kills them when its shutdown grace is over (`--shutdown-timeout 3` here, to keep the
    test short; the default is checked below). Both end inside the cluster's grace, the second with
    143 naming the signal and the workers it had to kill (it said nothing of them); nothing is left."""
    slow = ["--cue-rank", "1", "--cue", "mark", "--step-s", "0.3"]
    plain_args = [*slow, "--epochs", "6"]  # trains for 6 s more
    plain = Job(tmp_path / "plain", "--timeout", "10", "--max-restarts", "2", nproc=2, script_args=plain_args)
    stubborn_args = [*slow, "--epochs", "40", "--keep-on-term"]  # it would train on past the grace
    stubborn = Job(tmp_path / "stubborn", "--timeout", "10", "--shutdown-timeout", "3", nproc=2,
                   script_args=stubborn_args)  # fmt: skip
    took = {}

    def stop(name: str, job: Job) -> None:
        job.cue()
        took[name] = terminate_like_a_kubelet(job)

    threads = [
        threading.Thread(target=stop, args=item) for item in (("plain", plain), ("stubborn", stubborn))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + GRACE_S)
    assert plain.rc == 75, plain.err[-3000:]
    assert "unison launch: preempted (SIGTERM reached the launcher and its workers)" in plain.err
    assert stubborn.rc == 128 + signal.SIGTERM, stubborn.err[-3000:]
    assert "unison launch: stopped by SIGTERM" in stubborn.err, stubborn.err[-3000:]
    for job in (plain, stubborn):
        assert "restarting" not in job.err
    print(f"seconds from SIGTERM to the launcher's end: {took}")
    assert took["plain"] < 10, took
    assert took["stubborn"] < 3 + 10, took
    assert "2 workers did not end within 3 s of SIGTERM and were killed (SIGKILL)" in stubborn.err, (
        stubborn.err[-3000:]
    )
    assert leftovers(str(tmp_path)) == []


@pytest.mark.skipif(not TAKES_SHUTDOWN_TIMEOUT, reason="torch < 2.13: its agent has no shutdown grace to set")
def test_the_default_shutdown_grace_ends_the_launcher_inside_a_clusters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's agent gives workers 30 s after SIGTERM, the whole of Kubernetes' and SLURM's default
    grace: the launcher took 32.6 s, so a kubelet's SIGKILL at 30 s ended it without a word.
    unison gives them 20 s (measured with workers that ignore SIGTERM: the launcher ends 21.1-21.4 s
    after it, exit 143); --shutdown-timeout and TORCH_ELASTIC_SHUTDOWN_TIMEOUT still set it."""
    from unison.launch.launcher import SHUTDOWN_GRACE_S, parse_options, plan_launch

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    plan = plan_launch(parse_options(["--nproc", "2", str(script)]), str(tmp_path / "logs"))
    assert plan.config.shutdown_timeout == SHUTDOWN_GRACE_S
    assert SHUTDOWN_GRACE_S + 5 <= GRACE_S
    given = plan_launch(parse_options(["--shutdown-timeout", "7", str(script)]), str(tmp_path / "logs"))
    assert given.config.shutdown_timeout == 7
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")
    assert plan_launch(parse_options([str(script)]), str(tmp_path / "logs")).config.shutdown_timeout == 9


# ---- a network link cut for longer than --timeout, then restored ---------------------------------
def link(machines: Machines, up: bool) -> None:  # noqa: F811
    cmd = ["ip", "-n", machines.names[0], "link", "set", machines.links[0], "up" if up else "down"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.mark.launch
def test_a_network_cut_longer_than_the_timeout_ends_both_machines_or_resumes(
    machines: Machines,  # noqa: F811
    uninterrupted: str,
    tmp_path: Path,
) -> None:
    """Two jobs on the same two machines, one without restarts and one with --max-restarts 1; the
    link between the machines goes down mid-epoch (--timeout 5, 10 with restarts) and comes back
    only once the job without restarts ended on both machines (at least 20 s). Without restarts
    both machines end within timeout + 30 s of the cut, each naming the rank it lost, while the
    link is still down; with a restart the rendezvous waits for the lost machine (it used to give
    up after --timeout, as the cut was still on), and the job ends on the uninterrupted weights."""
    # On a loaded machine (a second copy of the suite beside it), with --timeout 5 for both jobs, the
    # restarting job's resumed attempt failed on a rank delayed past 5 s at its first step: it waits
    # 10 s. And the other job's launcher failed, before the cut, on a rendezvous store that took
    # more than 5 s to answer (its store reads wait --timeout): they wait 7 s (--rdzv-conf). The
    # machine without the store ends about 3 store reads after the cut (16 s with reads of 5 s,
    # 23 with 7, 33 with 10: too near the 35 s bound); the cut (20 s at least) outlasts both
    # timeouts: both jobs see it.
    timeout_s, read_s, cut_s = 5, 7, 20

    def node(i: int, folder: Path, port: int, restarts: int) -> Job:
        endpoint = f"{machines.addrs[0]}:{port}"
        args = [
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            endpoint,
            "--timeout",
            str(timeout_s if not restarts else 2 * timeout_s),
            "--max-restarts",
            str(restarts),
            *([] if restarts else ["--rdzv-conf", f"read_timeout={read_s}"]),
        ]
        script = ["--cue-rank", "1", "--cue", "hold"]
        return Job(folder, *args, script_args=script, prefix=machines.cmd(i, []))

    once_port, again_port = (netns_port() for _ in range(2))
    once = [node(i, tmp_path / "once", once_port, 0) for i in (0, 1)]
    again = [node(i, tmp_path / "again", again_port, 1) for i in (0, 1)]
    once[1].cue()
    again[1].cue()
    link(machines, up=False)
    cut = time.monotonic()
    for job in (once[0], again[0]):  # every rank waits at its step for this, then trains into the cut
        (job.folder / "go").touch()
    ended: dict[str, float] = {}
    waiters = [
        threading.Thread(target=lambda name=name, job=job: ended.__setitem__(name, job.finish() - cut))
        for name, job in (("once0", once[0]), ("once1", once[1]), ("again0", again[0]), ("again1", again[1]))
    ]
    for w in waiters:
        w.start()
    # The link stays down until both jobs without restarts ended (or their bound passed): the far
    # machine used to end only when the link came back, whatever the cut's length.
    deadline = cut + timeout_s + 30 + 15
    while time.monotonic() < deadline and not ("once0" in ended and "once1" in ended):
        time.sleep(0.2)
    time.sleep(max(0.0, cut + cut_s - time.monotonic()))  # the restarting job sees a cut of >= cut_s
    link(machines, up=True)
    for w in waiters:
        w.join(WAIT_S)
    for i, job in enumerate(once):
        assert job.rc == 1, job.err[-3000:]
        # The rendezvous deals the ranks; the worker names the rank it lost, or on the machine that
        # does not host the rendezvous store, its launcher may find the other machine gone first.
        here = int(re.search(r"^\[rank(\d)\]", job.err, re.MULTILINE).group(1))
        host = f"the node that has the address {machines.addrs[0]} hosts the rendezvous store, and it stopped"
        assert f"rank {1 - here} stopped taking part" in job.err or (i == 1 and host in job.err), job.err[
            -3000:
        ]
        assert ended[f"once{i}"] < timeout_s + 30, ended
    print(f"seconds from the cut to each launcher's end: {ended}")
    for job in again:
        assert job.rc == 0, job.err[-3000:]
        assert "restarting the workers" in job.err
    assert weights(again[0].out + again[1].out) == {uninterrupted}
    assert leftovers(str(tmp_path)) == []

"""The launch's failure report (unison.launch.failures), in this process, from real error files.

Each rank's error file is written by torch's own `ErrorHandler` (what `@record` and unison's worker
use), from a real exception; failures are torch's `ProcessFailure` reading those files, gathered in
a `ChildFailedError` as torch's agent gathers them. No launch: the in-process tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

from unison.callbacks.preemption import Preempted
from unison.launch.failures import (
    OomCount,
    deterministic_failure,
    error_headlines,
    exit_phrase,
    failure_summary,
    oom_count,
    oom_kills_since,
    preempted_headline,
    preempted_status,
    root_cause,
    sigkill_cause,
    unreadable_error_files,
)


def error_file(path: Path, exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Raise `exc` and let torch's ErrorHandler record it at `path`, as a failing worker does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise exc
    except BaseException as raised:  # noqa: B036  (Preempted is a SystemExit)
        ErrorHandler().record_exception(raised)
    return path


def failure(local_rank: int, exitcode: int, path: Path) -> ProcessFailure:
    return ProcessFailure(
        local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(path)
    )


@dataclass
class Logs:
    """The launch's per-rank logs as the summary reads them (the WorkerLogs protocol's fields)."""

    stderr_files: dict[int, str] = field(default_factory=dict)
    ranks: dict[int, int] = field(default_factory=dict)
    oom_kills: OomCount | None = None


def test_error_headlines_read_every_ranks_file_and_pass_over_torn_ones(tmp_path, monkeypatch):
    attempt = tmp_path / "attempt_0"
    error_file(attempt / "rank0.error.json", ValueError("broken on purpose"), monkeypatch)
    error_file(attempt / "rank1.error.json", Preempted("SIGTERM", 0, 3, "/ck/checkpoint.pth"), monkeypatch)
    (attempt / "rank2.error.json").write_text('{"mess')  # a kill cut its write short
    (attempt / "rank3.error.json").write_text(json.dumps({"message": "a program's own words"}))
    (attempt / "rank4.stderr.log").write_text("not an error file\n")
    assert list(error_headlines(attempt)) == [
        ("0", "ValueError: broken on purpose"),
        (
            "1",
            "Preempted: preempted by SIGTERM: every rank stopped in epoch 0, after step 3; "
            "checkpoint written to /ck/checkpoint.pth: resubmit with fit(..., resume=True)",
        ),
        ("3", "a program's own words"),
    ]
    assert preempted_headline(attempt).startswith("Preempted: preempted by SIGTERM: every rank stopped")
    assert preempted_headline(tmp_path / "attempt_9") is None  # no such attempt: nothing to say
    assert unreadable_error_files(str(tmp_path)) == [(2, attempt / "rank2.error.json")]


def test_the_newest_attempt_is_read_by_number_not_by_name(tmp_path, monkeypatch):
    """attempt_10 comes after attempt_9 (a string sort would read attempt_9)."""
    error_file(tmp_path / "attempt_9" / "rank0.error.json", ValueError("old"), monkeypatch)
    (tmp_path / "attempt_9" / "rank1.error.json").write_text("")
    stop = Preempted("SIGUSR1", 2, None, "/ck/c.pth")
    error_file(tmp_path / "attempt_10" / "rank1.error.json", stop, monkeypatch)
    (tmp_path / "attempt_10" / "rank0.error.json").write_text("{")
    assert unreadable_error_files(str(tmp_path)) == [(0, tmp_path / "attempt_10" / "rank0.error.json")]
    said = "every rank stopped at the end of epoch 2; checkpoint written to /ck/c.pth: resubmit with fit"
    assert preempted_status(str(tmp_path), "SIGUSR1") == (
        f"unison launch: preempted (SIGUSR1 reached the launcher and its workers): {said}"
        "(..., resume=True); exit status 75 (resume me)"
    )
    assert preempted_status(str(tmp_path), None).startswith(
        "unison launch: preempted (a signal reached the workers): every rank stopped at the end of epoch 2"
    )


def test_no_preempted_rank_gives_no_preempted_line(tmp_path, monkeypatch):
    error_file(tmp_path / "attempt_0" / "rank0.error.json", RuntimeError("boom"), monkeypatch)
    assert preempted_status(str(tmp_path), "SIGTERM") is None
    assert preempted_status(str(tmp_path / "empty"), "SIGTERM") is None
    assert unreadable_error_files(str(tmp_path / "empty")) == []


@pytest.mark.parametrize(
    "headline",
    [
        "MyCheckpointError: a subclass is named by its own name",
        "ConnectionRefusedError: [Errno 111] Connection refused",  # the network: a restart may do
    ],
)
def test_only_an_os_errors_errno_or_a_listed_class_makes_a_failure_deterministic(headline):
    """(The listed classes and errnos: tests/launch/test_failures.py.)"""
    assert deterministic_failure(headline) is None


def test_the_root_cause_is_the_rank_that_did_not_react_to_a_peer(tmp_path, monkeypatch):
    """torch's agent lists rank 0 first (its error file is older than the agent's sight of the killed
    rank 1); rank 0's error only says its peer went away, so rank 1 is the cause."""
    survivor = error_file(
        tmp_path / "rank0.error.json", RuntimeError("Connection closed by peer"), monkeypatch
    )
    err = ChildFailedError(
        "train.py", {0: failure(0, 1, survivor), 1: failure(1, -9, tmp_path / "rank1.error.json")}
    )
    rank, found = root_cause(err)
    assert (rank, found.exitcode) == (1, -9)
    text, code = failure_summary(err, log_dir="/logs")
    lines = text.splitlines()
    assert lines[0] == "unison launch: rank 1 failed (signal SIGKILL)"
    assert lines[1].startswith(
        "  (SIGKILL, exit status 137: sent by the kernel's OOM killer when memory runs out"
    )
    assert lines[2:] == [
        "  other ranks on this node that stopped or failed after it: 0 (exit code 1)",
        "  logs: /logs",
    ]
    assert code == 128 + 9
    # when every failure reacted to a peer, the first one torch's agent saw is named
    other = error_file(tmp_path / "rank1.error.json", RuntimeError("Broken pipe"), monkeypatch)
    both = ChildFailedError("train.py", {0: failure(0, 1, survivor), 1: failure(1, 1, other)})
    assert root_cause(both)[0] == 0
    text, code = failure_summary(both)
    assert "(its error says a peer went away: the first failure may be on another rank or node)" in text
    assert code == 1


def test_the_summary_shows_the_end_of_the_traceback_with_the_workers_exit_code(tmp_path, monkeypatch):
    def deep(n: int) -> None:
        if n == 0:
            raise ValueError("the real error")
        deep(n - 1)

    try:
        deep(20)
    except ValueError as exc:
        path = error_file(tmp_path / "rank3.error.json", exc, monkeypatch)
    stack = json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"].rstrip("\n").splitlines()
    err = ChildFailedError("train.py", {3: failure(1, 7, path)})
    text, code = failure_summary(err, lines=5)
    assert text.splitlines() == [
        "unison launch: rank 3 failed (exit code 7): ValueError: the real error",
        *(f"  | {line}" for line in stack[-5:]),
    ]
    assert stack[-1] == "ValueError: the real error" and code == 7


def test_without_an_error_file_the_summary_shows_the_end_of_the_ranks_stderr(tmp_path):
    stderr = tmp_path / "rank1.stderr.log"
    stderr.write_text("".join(f"line {i}\n" for i in range(30)))
    err = ChildFailedError("train.py", {1: failure(1, 3, tmp_path / "none.json")})
    logs = Logs(stderr_files={1: str(stderr)}, ranks={0: 0, 1: 1})
    text, code = failure_summary(err, logs, lines=3)
    assert text.splitlines() == [
        "unison launch: rank 1 failed (exit code 3)",
        "  | line 27",
        "  | line 28",
        "  | line 29",
        "  rank 0 had ended before, with exit status 0",
    ]
    assert code == 3


def test_a_rank_that_left_with_status_0_is_named_before_the_peer_it_stranded(tmp_path, monkeypatch):
    lost = error_file(tmp_path / "rank0.error.json", RuntimeError("Connection closed by peer"), monkeypatch)
    err = ChildFailedError("train.py", {0: failure(0, 1, lost)})
    text, _ = failure_summary(err, Logs(ranks={0: 0, 1: 1}))
    assert text.splitlines()[0] == (
        "unison launch: rank 1 left the job early (exit status 0 while the others still ran); "
        "then rank 0 failed (exit code 1): RuntimeError: Connection closed by peer"
    )


def vmstat_oom_kills() -> int:
    """/proc/vmstat's oom_kill, read here on its own."""
    fields = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(fields["oom_kill"])


def test_without_a_memory_cgroup_of_its_own_the_machines_count_is_read(tmp_path):
    # The machine's count rises with any OOM kill, a parallel test's too (xdist): read it again
    # until no kill landed while the assertions ran.
    for _ in range(20):
        start = vmstat_oom_kills()
        found = oom_count(root=tmp_path)  # an empty cgroup root: no memory cgroup files for this process
        quiet = oom_kills_since(found, root=tmp_path)  # nothing was killed meanwhile
        earlier = OomCount(found.kills - 1, "/proc/vmstat", False)  # as if one process was killed since
        since, cause = oom_kills_since(earlier, root=tmp_path), sigkill_cause(earlier, root=tmp_path)
        if vmstat_oom_kills() == start:
            break
    assert found == OomCount(start, "/proc/vmstat", False)
    assert quiet is None
    assert since == OomCount(1, "/proc/vmstat", False)
    assert cause.startswith(
        "possibly killed by the kernel's OOM killer (out of memory): it ended 1 process(es) on this machine"
    )
    assert exit_phrase(-9) == "signal SIGKILL"
    assert (exit_phrase(3), exit_phrase(0), exit_phrase(-15)) == (
        "exit code 3",
        "exit code 0",
        "signal SIGTERM",
    )


def test_the_jobs_own_memory_cgroup_counts_its_kills_and_those_below_it(tmp_path):
    """A cgroup tree laid out as this process's /proc/self/cgroup names it, under a folder of ours."""
    lines = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    v2 = [path for _, controllers, path in lines if controllers == "" and path != "/"]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",") and path != "/"]
    if v2:  # cgroup v2: memory.events counts the cgroups below too
        own = tmp_path / v2[0].lstrip("/") / "memory.events"
        own.parent.mkdir(parents=True)
        own.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")

        def kill_one_more() -> None:
            own.write_text("low 0\nhigh 0\nmax 5\noom 3\noom_kill 3\n")
    elif v1:  # cgroup v1: each cgroup counts its own; the tree below is summed
        own = tmp_path / "memory" / v1[0].lstrip("/") / "memory.oom_control"
        below = own.parent / "worker0" / "memory.oom_control"
        below.parent.mkdir(parents=True)
        own.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
        below.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")

        def kill_one_more() -> None:
            below.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    else:
        pytest.skip("this process is in the root cgroup: only the machine's count applies (tested above)")
    before = oom_count(root=tmp_path)
    assert before == OomCount(2, str(own), True)
    assert oom_kills_since(before, root=tmp_path) is None
    assert sigkill_cause(before, root=tmp_path).startswith("SIGKILL, exit status 137: sent by")
    kill_one_more()
    assert oom_kills_since(before, root=tmp_path) == OomCount(1, str(own), True)
    assert sigkill_cause(before, root=tmp_path) == (
        "killed by the kernel's OOM killer (out of memory): it ended 1 process(es) in this job's memory "
        f"cgroup during this attempt ({own} oom_kill); dmesg names them"
    )

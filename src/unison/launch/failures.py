"""What went wrong in a launch, in one summary: the root-cause rank, how it ended, its traceback.

torch's agent reports a `ChildFailedError` holding every failed worker; this module picks the
root cause (a rank whose error says a *peer* went away is never it when a better one exists),
says how it ended (exit code, signal, the kernel's OOM killer) and shows the end of its
traceback or stderr log. Nothing here supervises a process: torch's agent does.

>>> exit_phrase(-9)
'signal SIGKILL'
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from unison.signals import PREEMPTED_EXIT

if TYPE_CHECKING:  # torch is imported only once a launch starts: option errors come first (fast)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


def preempted_headline(attempt_dir: str | os.PathLike[str]) -> str | None:
    """The message of a rank that stopped on a preemption signal in that attempt, or None: workers
    record `Preempted` in torch's error file (`rank<R>.error.json`) before they exit 75.

        preempted_headline("/tmp/logs/attempt_0")
    """
    return next((h.strip() for _, h in error_headlines(attempt_dir) if h.startswith("Preempted:")), None)


def error_headlines(attempt_dir: str | os.PathLike[str]) -> Iterator[tuple[str, str]]:
    """(rank, message) of each rank's error file (`rank<R>.error.json`, torch's) in that attempt;
    a torn or unreadable file is passed over (a kill may cut its write short).

        list(error_headlines("/tmp/logs/attempt_0"))
    """
    for error_file in sorted(Path(attempt_dir).glob("rank*.error.json")):
        headline = error_headline(error_file)
        if headline is not None:
            yield error_file.name.split(".")[0].removeprefix("rank"), headline


def error_headline(error_file: str | os.PathLike[str]) -> str | None:
    """The error message in torch's error file `error_file` (None if there is none, or it is unreadable)."""
    try:
        message = json.loads(Path(error_file).read_text())["message"]
        return str(message["message"] if isinstance(message, dict) else message)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_attempt(log_dir: str | os.PathLike[str]) -> Path | None:
    """The newest `attempt_<k>` folder of a launch's logs, or None before the first."""
    attempts = sorted(Path(log_dir).glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    return attempts[-1] if attempts else None


def said_preempted(log_dir: str, signame: str | None) -> bool:
    """Print the launcher's line for a preempted job (`preempted_status`) and return True; else False."""
    line = preempted_status(log_dir, signame)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return line is not None


def preempted_status(log_dir: str, signame: str | None) -> str | None:
    """The launcher's line for a job whose workers stopped on a preemption signal (they wrote their
    checkpoint and exited `PREEMPTED_EXIT`), read from the newest attempt's error files; None when
    they did not.

        preempted_status("/tmp/logs", "SIGTERM")
    """
    attempt = latest_attempt(log_dir)
    headline = preempted_headline(attempt) if attempt is not None else None
    if headline is None:
        return None
    said = headline.removeprefix("Preempted:").strip()
    said = said.split(": ", 1)[1] if said.startswith("preempted by ") and ": " in said else said
    how = f"{signame} reached the launcher and its workers" if signame else "a signal reached the workers"
    return f"unison launch: preempted ({how}): {said}; exit status {PREEMPTED_EXIT} (resume me)"


#: Errors a restart on the same machine meets again, by class name (a subclass's name matches only
#: itself: DiskFullError is a CheckpointError, listed for the message). The checkpoint refused (torn,
#: of another model, another global batch), a full disk, a non-finite loss or gradient that resuming
#: from the last checkpoint recomputes, a script that cannot start.
DETERMINISTIC_ERRORS = frozenset(
    {
        "CheckpointError",
        "DiskFullError",
        "NonFiniteError",
        "SyntaxError",
        "IndentationError",
        "ModuleNotFoundError",
    }
)
#: OS errors of the same kind: the file system or its permissions, which a restart does not change.
DETERMINISTIC_ERRNOS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "disk quota exceeded",
}
_ERRNO = re.compile(r"\[Errno (\d+)\]")


def deterministic_failure(headline: str) -> str | None:
    """Why the error `headline` (a rank's error file's message: "OSError: [Errno 30] ...") would
    happen again after a restart, or None when a restart may get past it (a lost peer, a killed
    process, a network error). The one place `unison launch` decides that `--max-restarts` is
    worth spending.

    >>> deterministic_failure("OSError: [Errno 30] Read-only file system: '/ckpt/models'")
    'read-only file system (errno 30)'
    >>> deterministic_failure("unison.checkpoint.errors.CheckpointError: /ckpt/checkpoint.pth is damaged")
    'CheckpointError'
    >>> deterministic_failure("RuntimeError: Connection reset by peer") is None
    True
    """
    head = headline.strip()
    name = head.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    if name in DETERMINISTIC_ERRORS:
        return name
    found = _ERRNO.search(head.split("\n", 1)[0])
    if (
        found
        and (name.endswith("Error") or name == "OSError")
        and int(found.group(1)) in DETERMINISTIC_ERRNOS
    ):
        code = int(found.group(1))
        return f"{DETERMINISTIC_ERRNOS[code]} (errno {code})"
    return None


class WorkerLogs(Protocol):
    """What the summary reads of this node's per-rank logs (`unison.launch.logs.RankLogsSpecs`)."""

    stderr_files: dict[int, str]  # local rank -> its stderr log
    ranks: dict[int, int]  # local rank -> global rank
    oom_kills: OomCount | None  # the OOM killer's count (the job's cgroup, else the machine) at the start


def unreadable_error_files(log_dir: str) -> list[tuple[int, Path]]:
    """`(rank, path)` of the latest attempt's error files that are empty or not whole JSON.

    torch's agent fails on one (`JSONDecodeError`) instead of reporting the rank and restarting:
    unison's workers write theirs whole or not at all, but a `--no-python` program may not.

        unreadable_error_files("/tmp/logs")  # rank 1 was stopped while writing its error file
    """
    attempt = latest_attempt(log_dir)
    found = []
    for error_file in sorted(attempt.glob("rank*.error.json")) if attempt is not None else []:
        try:
            json.loads(error_file.read_text())
        except ValueError:
            found.append((int(error_file.name.split(".")[0].removeprefix("rank")), error_file))
        except OSError:
            continue
    return found


# Errors a rank raises because *another* rank went away: never the root cause when a better one exists.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL communicator was aborted",
)


def failure_message(failure: ProcessFailure) -> tuple[str, str]:
    """`(headline, traceback)` from the worker's error file, or empty strings."""
    msg: Any = failure.message
    if isinstance(msg, dict):
        return str(msg.get("message", "")), str(msg.get("extraInfo", {}).get("py_callstack", ""))
    if isinstance(msg, str) and os.path.isfile(failure.error_file):
        return msg, ""
    return "", ""


def is_peer_loss(failure: ProcessFailure) -> bool:
    """True when the failure reads like a consequence of another rank going away."""
    headline, stack = failure_message(failure)
    return any(p in headline or p in stack for p in _PEER_LOSS)


def reacted_to_a_peer(headline: str | None) -> bool:
    """True when an error's headline says another rank went away (a closed connection, or unison's
    watchdog: "rank 1 stopped taking part").

    >>> reacted_to_a_peer("RankStalledError: rank 1 stopped taking part: ...")
    True
    """
    return headline is not None and any(p in headline for p in (*_PEER_LOSS, "stopped taking part"))


def root_cause(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that most likely caused the others.

    torch's agent records failures in the order it saw them, and the ranks it stopped itself
    (SIGTERM) after them, so the first one wins; a rank whose error only says a peer went
    away yields to any other. (torch's own `get_first_failure` compares whole-second
    timestamps, which ties within a second and then names the lowest rank.)
    """
    order = list(err.failures)
    rank = min(order, key=lambda r: (is_peer_loss(err.failures[r]), order.index(r)))
    return rank, err.failures[rank]


def _tail(path: str | None, n: int) -> list[str]:
    if not path:
        return []
    try:
        with open(path, errors="replace") as fh:
            return [line.rstrip("\n") for line in fh.readlines()[-n:]]
    except OSError:
        return []


@dataclass(frozen=True)
class OomCount:
    """How many processes the kernel's OOM killer has ended, read where it can be told apart.

    `own_cgroup`: counted in this process's memory cgroup and those below it (the job's own: its
    workers inherit it), from `source` (cgroup v2 `memory.events`, or v1 `memory.oom_control`
    summed over the tree); False: the machine's count (/proc/vmstat), where another job's OOM
    kill counts too.
    """

    kills: int
    source: str
    own_cgroup: bool
    #: v1's count per cgroup of the tree: a cgroup removed since (another job step's, a test's) takes
    #: its kills out of the sum, so kills since a count are the rises per cgroup, not of the sum
    per_cgroup: tuple[tuple[str, int], ...] = field(default=(), repr=False, compare=False)


def _memory_cgroup_files(pid: int | str, root: Path) -> tuple[list[Path], str] | None:
    """The OOM-count files of `pid`'s memory cgroup, and the one to name; None without one of its own."""
    try:  # "ID:CONTROLLERS:PATH" lines -> (controllers, path)
        cgroups = [line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
    except OSError:
        return None
    # cgroup v2 ("0::/path"), alone or beside v1 hierarchies (then under unified/)
    for controllers, path in cgroups:
        if controllers == "" and path != "/":
            for mount in (root, root / "unified"):
                events = mount / path.lstrip("/") / "memory.events"
                if events.is_file():  # hierarchical: it counts the cgroups below too
                    return [events], str(events)
    # cgroup v1: counts are per cgroup (not summed up the tree): read the subtree
    for controllers, path in cgroups:
        if "memory" in controllers.split(",") and path != "/":
            top = root / "memory" / path.lstrip("/")
            if (top / "memory.oom_control").is_file():
                files = [Path(d) / "memory.oom_control" for d, _, _ in os.walk(top)]
                return files, str(top / "memory.oom_control")
    return None  # none, or the root cgroup ("/"): as good as the machine's count


def _count(files: list[Path]) -> dict[str, int] | None:
    """Each file's oom_kill count (None where no file has one): cgroup files, or /proc/vmstat."""
    counts: dict[str, int] = {}
    for path in files:
        try:
            for line in path.read_text().splitlines():
                if line.startswith("oom_kill "):
                    counts[str(path)] = int(line.split()[1])
        except (OSError, ValueError):
            continue  # a cgroup removed since the walk
    return counts or None


def oom_count(pid: int | str = "self", root: str | os.PathLike[str] = "/sys/fs/cgroup") -> OomCount | None:
    """The OOM killer's count for `pid`'s memory cgroup (the launcher's: its workers are in it), or
    the machine's (/proc/vmstat) where it has none of its own; None where neither can be read.

        oom_count()
    """
    found = _memory_cgroup_files(pid, Path(root))
    if found is not None:
        counts = _count(found[0])
        if counts is not None:
            return OomCount(sum(counts.values()), found[1], True, tuple(sorted(counts.items())))
    machine = _count([Path("/proc/vmstat")])
    return OomCount(machine["/proc/vmstat"], "/proc/vmstat", False) if machine is not None else None


def oom_kills_since(
    before: OomCount | None, root: str | os.PathLike[str] = "/sys/fs/cgroup"
) -> OomCount | None:
    """The OOM kills counted since `before` (read the same way), or None when there were none.

    For example:

        oom_kills_since(OomCount(0, "/proc/vmstat", False))
    """
    if before is None:
        return None
    now = oom_count(root=root)
    if now is None or now.source != before.source:
        return None
    if now.per_cgroup and before.per_cgroup:  # rises per cgroup: one removed must not hide another's kill
        earlier = dict(before.per_cgroup)
        kills = sum(max(0, n - earlier.get(path, 0)) for path, n in now.per_cgroup)
    else:
        kills = now.kills - before.kills
    return OomCount(kills, now.source, now.own_cgroup) if kills > 0 else None


def sigkill_cause(before: OomCount | None, root: str | os.PathLike[str] = "/sys/fs/cgroup") -> str:
    """What a worker's SIGKILL most likely was: the OOM killer if it ended a process of this job
    since `before` (the count when the attempt started), "possibly" the OOM killer if only the
    machine's count says so (another job's kill counts there), else the usual senders.

        sigkill_cause(OomCount(3, "/sys/fs/cgroup/job.slice/memory.events", True))  # 4 there now
    """
    kills = oom_kills_since(before, root)
    if kills is not None and kills.own_cgroup:
        return (
            f"killed by the kernel's OOM killer (out of memory): it ended {kills.kills} process(es) in this "
            f"job's memory cgroup during this attempt ({kills.source} oom_kill); dmesg names them"
        )
    if kills is not None:
        return (
            f"possibly killed by the kernel's OOM killer (out of memory): it ended {kills.kills} process(es) "
            "on this machine during this attempt, maybe of another job (/proc/vmstat oom_kill: this job has "
            "no memory cgroup of its own to tell); dmesg names them, or kill -9 or a scheduler sent it"
        )
    return (
        "SIGKILL, exit status 137: sent by the kernel's OOM killer when memory runs out (dmesg says so), "
        "by kill -9, or by a scheduler's hard stop"
    )


def exit_phrase(exitcode: int, oom_before: OomCount | None = None) -> str:
    """How a worker ended, in a few words: "exit code 1", "signal SIGKILL, killed by the kernel's OOM killer".

    >>> exit_phrase(-9, oom_before=None)
    'signal SIGKILL'
    """
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = str(-exitcode)  # a real-time signal: its number
    if -exitcode == signal.SIGKILL and oom_before is not None:
        cause = sigkill_cause(oom_before)
        if cause.startswith(("killed by", "possibly killed by")):
            return f"signal {name}, {cause.split(':')[0]}"
    return f"signal {name}"


def failure_summary(
    err: ChildFailedError, logs: WorkerLogs | None = None, log_dir: str | None = None, lines: int = 12
) -> tuple[str, int]:
    """One summary of a failed launch and the exit code to return.

    Names the root-cause rank, its exit code or signal, and the last `lines` of its traceback
    (from torch's error file; else the end of its stderr log). The exit code is the worker's
    own, or 128 + signal number for a worker killed by a signal (the shell's convention).
    """
    rank, failure = root_cause(err)
    how = exit_phrase(failure.exitcode)
    headline, stack = failure_message(failure)
    body = stack.rstrip("\n").splitlines()[-lines:] if stack else []
    if not body and logs is not None:
        body = _tail(logs.stderr_files.get(failure.local_rank), lines)
    first = f"rank {rank} failed ({how}){': ' + headline if headline else ''}"
    # torch's agent counts exit 0 as that worker's success: a rank of this node missing from the
    # failures had ended with 0 while the others ran (the agent stops the rest, recorded as failures).
    ended = sorted(set(logs.ranks.values()) - set(err.failures)) if logs is not None else []
    peer_loss = is_peer_loss(failure) or "left the training early" in headline
    if ended and peer_loss:
        names = ", ".join(map(str, ended))
        first = f"rank {names} left the job early (exit status 0 while the others still ran); then {first}"
    out = [f"unison launch: {first}"]
    out += [f"  | {line}" for line in body]
    if failure.exitcode == -signal.SIGKILL:
        out.append(f"  ({sigkill_cause(logs.oom_kills if logs is not None else None)})")
    if ended and not peer_loss:
        out.append(f"  rank {', '.join(map(str, ended))} had ended before, with exit status 0")
    elif is_peer_loss(failure) and not ended:
        out.append("  (its error says a peer went away: the first failure may be on another rank or node)")
    others = [f"{r} ({exit_phrase(f.exitcode)})" for r, f in sorted(err.failures.items()) if r != rank]
    if others:
        out.append(f"  other ranks on this node that stopped or failed after it: {', '.join(others)}")
    if log_dir:
        out.append(f"  logs: {log_dir}")
    code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1  # 137: SIGKILL
    return "\n".join(out), code

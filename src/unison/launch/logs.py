"""Where each rank's output goes under `unison launch`, and whether a restart can succeed.

`RankLogsSpecs` is the `LogsSpecs` torch's agent asks at every attempt: per-rank log files,
the console tee, the error file path; it also refuses a restart that would hit the same
failure at once (`pointless_restart`). Imported when a launch starts (it needs torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TextIO, cast

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, Std

from unison.launch.bar_relay import StandIn
from unison.launch.failures import (
    OomCount,
    deterministic_failure,
    error_headline,
    error_headlines,
    exit_phrase,
    oom_count,
    oom_kills_since,
    reacted_to_a_peer,
)
from unison.launch.rendezvous import private_dir, private_files
from unison.launch.torch_compat import StorePortHold

__all__ = ["RankLogsSpecs", "RestartRefused", "pointless_restart"]


class HeldPortLogsSpecs(DefaultLogsSpecs):
    """torch's own logs (`unison.spawn`'s), with each attempt's store port held (`StorePortHold`).

    reify is torch's one per-attempt hook that sees the workers' environments before they start.

    >>> specs = HeldPortLogsSpecs(log_dir="/tmp/logs")
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store_port = StorePortHold()

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.store_port.assign(envs)
        return super().reify(envs)


class RankLogsSpecs(HeldPortLogsSpecs):
    """Where torch's agent sends each worker's output: files per rank, tailed to the console.

    Every rank's stdout and stderr go to `<log_dir>/attempt_<k>/rank<R>.stdout.log` and
    `.stderr.log` (`k`: which start of this node's workers, from 0; `R`: global rank); torch's
    error file next to them is `rank<R>.error.json`. torch's tailer prints them with the launch's line prefix
    (`[rank0] `): both streams of every rank, except local ranks outside `ranks_filter`
    (torchrun's `--local-ranks-filter`) and the streams `redirects` keeps off the console
    (torchrun's `--redirects`: "1" stdout, "2" stderr, "3" both, or "0:1,1:3" per local rank).
    Each attempt's store port is held as `HeldPortLogsSpecs` holds it (`reify` is its own here).

    >>> specs = RankLogsSpecs("/tmp/logs", ranks_filter={0}, redirects="0")
    """

    def __init__(
        self,
        log_dir: str,
        ranks_filter: Collection[int] | None = None,
        redirects: str = "0",
        replica: str | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)
        self.ranks_filter = None if ranks_filter is None else frozenset(ranks_filter)
        self.console_off = Std.from_str(redirects)
        #: local rank -> stderr file of the latest attempt (the summary's fallback when no traceback)
        self.stderr_files: dict[int, str] = {}
        self.attempts = 0  # worker groups started so far on this node (the log folder's number)
        self.restart = "0"  # torch's TORCHELASTIC_RESTART_COUNT of the latest one
        self.ranks: dict[int, int] = {}  # local rank -> global rank, in the latest attempt
        #: the OOM killer's count when the attempt started (this job's memory cgroup, else the machine's)
        self.oom_kills: OomCount | None = None
        self.console_lost = False  # the console's stdout or stderr went away (a closed pipe)
        self.notes = _AGENT_NOTES.reset()  # what torch's agent logged about its workers
        self.replica = replica  # this launch is one torchft replica group (`--replica-id`): its name
        self.on_attempt: Callable[[], None] | None = None  # called as each attempt starts (bar relay)
        self._consoles: tuple[_Console, ...] = ()  # the console's streams while `console_guard` holds them

    def on_console(self, local_rank: int, stream: Std) -> bool:
        """True when `stream` (Std.OUT or Std.ERR) of `local_rank` is shown on the console."""
        if self.ranks_filter is not None and local_rank not in self.ranks_filter:
            return False
        off = self.console_off
        if isinstance(off, dict):
            off = off.get(local_rank, Std.NONE)
        return not off & stream

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self.on_attempt is not None:
            self.on_attempt()
        first = next(iter(envs.values()), {})
        restart = first.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Counted here: torch's count stays put on a node restarting its workers for a re-joining
        # node, and that attempt's logs must not overwrite the previous one's.
        attempt, self.attempts = self.attempts, self.attempts + 1
        if attempt:  # torch's agent restarts the workers: say so (its own log is silenced)
            hopeless = pointless_restart(os.path.join(self.root_log_dir, f"attempt_{attempt - 1}"))
            # A node (re)joining stops every worker with SIGTERM: they checkpoint and stop as on a
            # preemption, and that restart goes on (from their checkpoint); a failure's does not.
            if hopeless and not (" Preempted: " in hopeless and restart == self.restart):
                raise RestartRefused(f"not restarting: {hopeless}")
            if restart != self.restart:
                most = first.get("TORCHELASTIC_MAX_RESTARTS", "?")
                why = self._last_failure(os.path.join(self.root_log_dir, f"attempt_{attempt - 1}"))
                line = f"unison launch: restarting the workers (restart {restart} of {most}){why}"
                if self.replica is not None:  # one replica group of several: only this one restarts
                    r = self.replica
                    line = (
                        f"unison launch: replica {r}: {why.removeprefix(': ') or 'a worker failed'}; "
                        f"restarting replica {r} ({restart}/{most}); the other replicas keep training"
                    )
                self.say(line)
            else:
                self.say(
                    "unison launch: restarting the workers: a node (re)joined the job (not counted against "
                    "--max-restarts)"
                )
        self.restart = restart
        self.ranks, self.oom_kills = {}, oom_count()
        self.store_port.assign(envs)
        # 0700, files 0600: logs may hold secrets, and other local users must not read them.
        base = private_dir(os.path.join(self.root_log_dir, f"attempt_{attempt}"))
        dest = LogsDest(
            filtered_stdout=os.path.join(base, "filtered_stdout.log"),
            filtered_stderr=os.path.join(base, "filtered_stderr.log"),
        )
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
            self.ranks[local_rank] = rank
            stem = os.path.join(base, f"rank{rank}")
            out, err, error_file = f"{stem}.stdout.log", f"{stem}.stderr.log", f"{stem}.error.json"
            with contextlib.suppress(FileNotFoundError):
                os.remove(error_file)  # a stale one from an earlier run would be read as this failure
            private_files(out, err)
            dest.stdouts[local_rank], dest.stderrs[local_rank] = out, err
            if self.on_console(local_rank, Std.OUT):
                dest.tee_stdouts[local_rank] = out
            if self.on_console(local_rank, Std.ERR):
                dest.tee_stderrs[local_rank] = err
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
            self.stderr_files[local_rank] = err
        return dest

    def _last_failure(self, attempt_dir: str) -> str:
        """`: rank 1 failed (signal SIGKILL, ...)`: the failure the agent restarts after, if it logged one."""
        failed, self.notes.failed = self.notes.failed, None
        if failed is None:
            return ""
        exitcode, local_rank = failed
        rank = self.ranks.get(local_rank, local_rank)
        silent = self._silent_culprit(attempt_dir, rank, exitcode)
        if silent is not None:
            rank, exitcode = silent, -signal.SIGKILL
        headline = (
            error_headline(os.path.join(attempt_dir, f"rank{rank}.error.json")) if exitcode >= 0 else None
        )
        how = exit_phrase(exitcode, self.oom_kills)
        if self.replica is not None:
            return f": worker rank {rank} exited with {how}{': ' + headline if headline else ''}"
        return f": rank {rank} failed ({how}){': ' + headline if headline else ''}"

    def _silent_culprit(self, attempt_dir: str, rank: int, exitcode: int) -> int | None:
        """The rank the OOM killer ended, when torch's agent named another one.

        The agent names the failure with the earliest timestamp, and a rank with an error file
        carries the time it wrote it: a survivor that failed at once on its dead peer (or that the
        agent then stopped with SIGTERM) writes before the agent sees the peer, which left no file.
        When the OOM killer fired during the attempt and exactly one other rank left no error file,
        that rank is the one it killed."""
        noted = os.path.join(attempt_dir, f"rank{rank}.error.json")
        reacted = exitcode == -signal.SIGTERM or reacted_to_a_peer(error_headline(noted))
        if not reacted or oom_kills_since(self.oom_kills) is None:
            return None
        silent = [
            r
            for r in self.ranks.values()
            if r != rank and not os.path.exists(os.path.join(attempt_dir, f"rank{r}.error.json"))
        ]
        return silent[0] if len(silent) == 1 else None

    def stragglers(self, signame: str, grace: float | None) -> str:
        """ " (2 workers did not end within 20 s of SIGTERM and were killed (SIGKILL))", or ""."""
        killed = self.notes.killed
        if not killed:
            return ""
        within = f"within {grace:g} s " if grace is not None else ""
        workers = f"{killed} workers" if killed > 1 else "1 worker"
        were = "were" if killed > 1 else "was"
        return f" ({workers} did not end {within}of {signame} and {were} killed (SIGKILL))"

    @contextlib.contextmanager
    def console_guard(self) -> Iterator[None]:
        """While torch's agent runs, its tailers write every rank's lines to a console that may go
        away (a pipe whose reader exits). The workers never write to it (their output goes to
        files), so training goes on: the lines are dropped, once said on the other stream, and
        the log files are kept (`console_lost`) so nothing is lost."""
        saved = sys.stdout, sys.stderr
        self._consoles = (_Console(saved[0], "stdout", self), _Console(saved[1], "stderr", self))
        sys.stdout, sys.stderr = self._consoles
        try:
            yield
        finally:
            self.end_partial_lines()  # what the launcher says next (the summary) starts a line
            sys.stdout, sys.stderr = saved
            self._consoles = ()

    def end_partial_lines(self) -> None:
        """End a rank's last line that its process cut off (killed mid-line: the tailer shows it
        without its end), so the launcher's next line does not come glued to it."""
        for console in self._consoles:
            console.end_line()

    def say(self, line: str) -> None:
        """Print one of the launcher's own lines to the console's stderr, on a line of its own."""
        self.end_partial_lines()
        print(line, file=sys.stderr, flush=True)

    def lost_console(self, name: str, exc: BaseException) -> None:
        """Say once (on the stream still open) that the console's `name` went away, and keep the logs."""
        with _LOCK:  # the tailers write from threads of their own
            first, self.console_lost = not self.console_lost, True
        if not first:
            return
        other = sys.__stderr__ if name == "stdout" else sys.__stdout__
        with contextlib.suppress(Exception):
            print(
                f"unison launch: note: the console's {name} was closed ({type(exc).__name__}): the workers "
                f"go on, and every rank's output is kept in {self.root_log_dir} "
                f"(attempt_<k>/rank<R>.{name}.log)",
                file=other,
                flush=True,
            )


#: The prefix torch's tailer puts before each piece of a rank's output it read (`[rank1] `).
_RANK_PREFIX = re.compile(r"\[[^\]\n]*\] ?")


class _Console(StandIn):
    """A console stream that, once its reader is gone, drops what is written instead of raising.

    torch's tailer writes each piece of a rank's file it read, with the rank's prefix: a line the
    rank wrote in two parts (a loaded machine reads in between) comes as two prefixed pieces. The
    second piece of the line still open here goes on without its prefix; another rank's piece
    ends the open line first."""

    def __init__(self, stream: TextIO, name: str, owner: RankLogsSpecs) -> None:
        super().__init__(stream)
        self._name, self._owner = name, owner
        self._gone = False
        self._mid_line = False  # the last text written did not end its line
        self._open_prefix: str | None = None  # the rank prefix of that open line

    def end_line(self) -> None:
        """Write an end of line if the last text written left its line open."""
        with _LOCK:
            mid_line, self._mid_line = self._mid_line, False
        if mid_line:
            self.write("\n")

    def _lost(self, exc: BaseException) -> None:
        self._gone = True
        with contextlib.suppress(Exception):  # later writes and the exit's flush must not fail either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        self._owner.lost_console(self._name, exc)

    def write(self, text: str) -> int:
        shown = text
        if text:
            found = _RANK_PREFIX.match(text)
            prefix = found.group(0) if found else None
            with _LOCK:
                if prefix is not None and self._mid_line:
                    # the rest of the open line: no second prefix; another rank's: on a line of its own
                    shown = text[len(prefix) :] if prefix == self._open_prefix else "\n" + text
                self._mid_line = not text.endswith("\n")
                self._open_prefix = prefix if self._mid_line else None
        if not self._gone:
            try:
                self._stream.write(shown)
                if "\n" in text:
                    self._stream.flush()
            except (OSError, ValueError) as exc:  # EPIPE, a closed file
                self._lost(exc)
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._lost(exc)

    def isatty(self) -> bool:
        return not self._gone and self._stream.isatty()


class _AgentNotes(logging.Handler):
    """What torch's agent logs about its workers (its logs are off the console): the failure it
    restarts after, and how many workers it had to kill after the shutdown grace."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failed: tuple[int, int] | None = None  # (exit code or -signal, local rank)
        self.killed = 0

    def reset(self) -> _AgentNotes:
        logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        if self not in logger.handlers:
            logger.addHandler(self)
        self.failed, self.killed = None, 0
        return self

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        with contextlib.suppress(TypeError, ValueError, IndexError):
            if msg.startswith("failed (exitcode: %s) local_rank: %s"):
                args = record.args if isinstance(record.args, tuple) else ()
                self.failed = (int(cast(int, args[0])), int(cast(int, args[1])))
            elif msg.startswith("Unable to shutdown process"):
                self.killed += 1


_AGENT_NOTES = _AgentNotes()
_LOCK = threading.Lock()


class RestartRefused(RuntimeError):
    """A restart that cannot succeed (the last attempt failed on a full disk, or stopped on a
    non-finite loss or gradient that resuming from the last checkpoint meets again) or must not
    happen (the workers stopped on a preemption signal): the launch stops."""


def pointless_restart(attempt_dir: str) -> str | None:
    """Why restarting after the attempt logged in `attempt_dir` cannot succeed, or None: a rank failed
    with an error a restart meets again (`failures.deterministic_failure`: a full disk, a
    non-finite loss, a refused checkpoint, a read-only folder), or stopped on a preemption signal
    (the job is to stop, checkpointed).

        pointless_restart("/tmp/logs/attempt_0")  # a rank failed with DiskFullError there
    """
    for rank, headline in error_headlines(attempt_dir):
        preempted = headline.startswith("Preempted:") or ".Preempted:" in headline
        if preempted or deterministic_failure(headline) is not None:
            return f"rank {rank} failed with {headline.strip()}"
    return None

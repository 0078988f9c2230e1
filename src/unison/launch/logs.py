"""Where each rank's output goes under `unison launch`, and whether a restart can succeed.

`RankLogsSpecs` is the `LogsSpecs` torch's agent asks at every attempt: per-rank log files,
the console tee, the error file path; it also refuses a restart that would hit the same
failure at once (`pointless_restart`). Imported when a launch starts (it needs torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Collection
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

from unison.launch.rendezvous import private_dir, private_files

__all__ = ["RankLogsSpecs", "RestartRefused", "pointless_restart"]


class RankLogsSpecs(LogsSpecs):
    """Where torch's agent sends each worker's output: files per rank, tailed to the console.

    Every rank's stdout and stderr go to `<log_dir>/attempt_<k>/rank<R>.stdout.log` and
    `.stderr.log` (`k`: which start of this node's workers, from 0; `R`: global rank); torch's
    error file next to them is `rank<R>.error.json`. torch's tailer prints them with the launch's line prefix
    (`[rank0] `): both streams of every rank, except local ranks outside `ranks_filter`
    (torchrun's `--local-ranks-filter`) and the streams `redirects` keeps off the console
    (torchrun's `--redirects`: "1" stdout, "2" stderr, "3" both, or "0:1,1:3" per local rank).

    >>> specs = RankLogsSpecs("/tmp/logs", ranks_filter={0}, redirects="0")
    """

    def __init__(
        self, log_dir: str, ranks_filter: Collection[int] | None = None, redirects: str = "0"
    ) -> None:
        super().__init__(log_dir, redirects=Std.ALL, tee=Std.ALL)
        self.ranks_filter = None if ranks_filter is None else frozenset(ranks_filter)
        self.console_off = Std.from_str(redirects)
        #: local rank -> stderr file of the latest attempt (the summary's fallback when no traceback)
        self.stderr_files: dict[int, str] = {}
        self.attempts = 0  # worker groups started so far on this node (the log folder's number)
        self.restart = "0"  # torch's TORCHELASTIC_RESTART_COUNT of the latest one

    def on_console(self, local_rank: int, stream: Std) -> bool:
        """True when `stream` (Std.OUT or Std.ERR) of `local_rank` is shown on the console."""
        if self.ranks_filter is not None and local_rank not in self.ranks_filter:
            return False
        off = self.console_off
        if isinstance(off, dict):
            off = off.get(local_rank, Std.NONE)
        return not off & stream

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        first = next(iter(envs.values()), {})
        restart = first.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Counted here: torch's count stays put on a node restarting its workers for a re-joining
        # node, and that attempt's logs must not overwrite the previous one's.
        attempt, self.attempts = self.attempts, self.attempts + 1
        if attempt:  # torch's agent restarts the workers: say so (its own log is silenced)
            hopeless = pointless_restart(os.path.join(self.root_log_dir, f"attempt_{attempt - 1}"))
            if hopeless:
                raise RestartRefused(f"not restarting: {hopeless}")
            if restart != self.restart:
                most = first.get("TORCHELASTIC_MAX_RESTARTS", "?")
                print(f"unison launch: restarting the workers (restart {restart} of {most})", file=sys.stderr)
            else:
                print(
                    "unison launch: restarting the workers: a node (re)joined the job (not counted against "
                    "--max-restarts)",
                    file=sys.stderr,
                )
        self.restart = restart
        # 0700, files 0600: logs may hold secrets, and other local users must not read them.
        base = private_dir(os.path.join(self.root_log_dir, f"attempt_{attempt}"))
        dest = LogsDest(
            filtered_stdout=os.path.join(base, "filtered_stdout.log"),
            filtered_stderr=os.path.join(base, "filtered_stderr.log"),
        )
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
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


class RestartRefused(RuntimeError):
    """A restart that cannot succeed (the last attempt failed on a full disk, or stopped on a
    non-finite loss or gradient that resuming from the last checkpoint meets again): the launch stops."""


#: Failures a restart on the same machine would hit again at once.
_HOPELESS = ("DiskFullError", "NonFiniteError")


def pointless_restart(attempt_dir: str) -> str | None:
    """Why restarting after the attempt logged in `attempt_dir` cannot succeed, or None.

    >>> pointless_restart("/tmp/logs/attempt_0")  # a rank failed with DiskFullError there
    'rank 0 failed with DiskFullError: disk full (ENOSPC; OSError: [Errno 28] ...) writing ...'
    """
    for error_file in sorted(Path(attempt_dir).glob("rank*.error.json")):
        try:
            message = json.loads(error_file.read_text())["message"]
            headline = str(message["message"] if isinstance(message, dict) else message)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if any(headline.startswith(f"{name}:") or f".{name}:" in headline for name in _HOPELESS):
            rank = error_file.name.split(".")[0].removeprefix("rank")
            return f"rank {rank} failed with {headline.strip()}"
    return None

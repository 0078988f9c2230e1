"""`unison launch` as a fork of a process that preloaded torch, for a tool that launches many times.

`unison check-exact` launches the user's script two to four times. Each launch as a fresh
interpreter imports torch and `torch._dynamo` again, which is most of a short launch's cost. A
process that imported the zygote's `PRELOAD` itself and says so (`PRELOADED_PID_ENV` holds its
pid, as the test suite's warm runner sets for its children) can instead fork each launch: the
forked launcher is then that preloaded process in turn (`zygote.can_fork`), its zygote and
workers forks of it, with nothing left to import (docs/benchmarks.md has the figures). Anywhere
else (`preloaded()` is False) the launch is a fresh interpreter.

    proc = start(["--nproc", "2", "train.py"], env=env, log=log)  # Popen, or a ForkedLaunch
    status = proc.wait(timeout=600)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, NoReturn

from unison.env_names import PRELOADED_PID_ENV
from unison.launch.worker import end_process, exit_status

__all__ = ["ForkedLaunch", "preloaded", "start"]

_POLL_S = 0.05


def preloaded() -> bool:
    """Whether this process says it preloaded torch for forks (`PRELOADED_PID_ENV` is its pid) and
    runs no other thread, so that a fork of it is safe.

    >>> preloaded() in (True, False)
    True
    """
    return os.environ.get(PRELOADED_PID_ENV) == str(os.getpid()) and threading.active_count() == 1


class ForkedLaunch:
    """A launcher forked from this process, with what a caller of `subprocess.Popen` uses:
    `pid`, `returncode`, `poll`, `wait(timeout)` (raising `subprocess.TimeoutExpired`),
    `terminate` and `kill`."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_launcher(args: Sequence[str], env: Mapping[str, str], log: IO[str]) -> NoReturn:
    """In the forked child: take the launch's output and environment, run the launcher, leave."""
    status = 1
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (the launch's streams)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.environ[PRELOADED_PID_ENV] = str(os.getpid())  # this child is the preloaded process now
        sys.argv = [sys.executable, "-m", "unison.launch", *args]
        from unison.launch.launcher import main

        status = main(list(args))
    except SystemExit as exc:
        status = exit_status(exc)  # as Python exits
    except BaseException:  # noqa: BLE001  (nothing may return into the caller's code)
        traceback.print_exc()
    end_process(status & 0xFF)


def start(args: Sequence[str], env: Mapping[str, str], log: IO[str]) -> subprocess.Popen | ForkedLaunch:
    """`python -m unison.launch ARGS` with `env`, its output into `log`: a fork of this process
    where it is `preloaded()`, else a fresh interpreter."""
    if not preloaded():
        cmd = [sys.executable, "-m", "unison.launch", *args]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    for stream in (sys.stdout, sys.stderr, log):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        _run_launcher(args, env, log)
    return ForkedLaunch(pid, args)

"""What a test shows when a command it started does not finish: every process of its tree, with its
state and its Python stacks, then the tree killed (no worker left running behind the test).

The stacks come from Python's own `faulthandler`: the suite sets `PYTHONFAULTHANDLER=1`
(tests/conftest.py), so every Python process it starts dumps its threads' stacks to its stderr on
SIGABRT. A launched worker's stderr reaches the launcher's (torch's tailer), which the test captures;
so the workers are dumped first, the launcher a moment later.

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_report(proc, timeout=300)   # pytest.fail with the stacks past 300 s
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import psutil
import pytest

from tests.warm_runner import WarmProcess, start

#: Seconds the launcher's tailer gets to pass its workers' dumps on before it is dumped itself.
TAIL_S = 1.5


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def describe_tree(pid: int) -> str:
    """One line per process under `pid`: pid, state, command line."""
    lines = []
    for proc in _tree(pid):
        with contextlib.suppress(psutil.Error):
            lines.append(f"  {proc.pid} {proc.status()}: {' '.join(proc.cmdline())[:240]}")
    return "\n".join(lines) or "  (no child process)"


def dump_and_kill(proc: subprocess.Popen | WarmProcess) -> str:
    """Dump the stacks of `proc`'s descendants, then its own (SIGABRT), kill them all; return the tree."""
    tree_text = describe_tree(proc.pid)
    children = _tree(proc.pid)
    for child in reversed(children):  # the deepest first: workers before their launcher
        with contextlib.suppress(psutil.Error):
            child.send_signal(signal.SIGABRT)
    if children:
        time.sleep(TAIL_S)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGABRT)
    time.sleep(0.2)
    for child in [*children, *_tree(proc.pid)]:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.kill()
    return tree_text


def wait_for_file(proc: subprocess.Popen, path: Any, timeout: float, what: str, poll_s: float = 0.05) -> None:
    """Poll until `path` exists; fail with `what` if `proc` ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, what
        time.sleep(poll_s)


def communicate_or_report(
    proc: subprocess.Popen | WarmProcess, timeout: float, what: str = ""
) -> tuple[str, str]:
    """`proc.communicate(timeout)`; past it, fail the test with the processes, their stacks and output."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree_text = dump_and_kill(proc)
        out, err = proc.communicate()
        shown = 4000 if err is not None else 24000  # stderr sent to stdout: the stacks are there
        pytest.fail(
            f"{what or proc.args} did not finish in {timeout:g}s; its processes were:\n{tree_text}\n"
            f"stdout (end):\n{(out or '')[-shown:]}\nstderr (end, with the stacks):\n{(err or '')[-20000:]}"
        )


def run_or_report(
    args: Sequence[str], timeout: float, input: str | None = None, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout, ...)`, except that past
    `timeout` the test fails with every process's state and stacks and none is left running.

    >>> proc = run_or_report([sys.executable, "-m", "unison.launch", "--nproc", "2", script], 300, cwd=tmp)
    """
    # A Python command runs as a fork of a warm interpreter (tests/warm_runner.py: torch imported once).
    proc = start(
        args,
        stdin=subprocess.PIPE if input is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )
    if input is not None:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = communicate_or_report(proc, 0)
    else:
        out, err = communicate_or_report(proc, timeout)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def wait_ended(pid: int, timeout: float, what: str) -> None:
    """Poll until process `pid` has ended (gone, or a zombie its parent has yet to reap); past
    `timeout` seconds the test fails saying `what` still runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"{what} still runs after {timeout:g} s"
        time.sleep(0.05)

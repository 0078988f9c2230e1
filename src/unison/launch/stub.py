"""The stub: the process torch's agent starts for a rank, when the worker is forked by the zygote.

torch's agent runs `python -m unison.launch.worker script.py ...` for every rank; where the launch
has a zygote (`launch.zygote`, the warm start) that process imports no torch. It connects to the
zygote, passes it its stdin, stdout and stderr (as descriptors), its arguments, environment and
folder, and the zygote forks the worker. The stub then passes on every signal it gets (the
agent's SIGTERM, a preemption signal) and ends as the worker ended: the same exit code, or killed
by the same signal, so the agent, the failure summary and a restart see what a cold worker gives.

    run_in_zygote(os.environ["UNISON_ZYGOTE"], ["train.py", "--epochs", "3"])
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Any, NoReturn

__all__ = ["FORWARDED", "REQUEST_HEADER", "catchable_signals", "default_handler", "end_as", "run_in_zygote"]

#: The signals a stub passes on to its worker (torch's agent's death signal, the preemption ones).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
#: A request is this header (the JSON's length), sent with the three descriptors, then the JSON.
REQUEST_HEADER = struct.Struct("!I")
_CONNECT_WAIT_S = 30.0  # the zygote listens within milliseconds of starting; a stub waits this long at most


def _connect(path: str) -> socket.socket | None:
    """A connection to the zygote at `path`; None when there is none to wait for (start cold then).

    The zygote binds its socket milliseconds after it starts, so a missing socket in a folder
    that exists is waited for; a folder removed (the launch is ending) or a socket nobody
    listens on (the zygote died) is not.
    """
    deadline = time.monotonic() + _CONNECT_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except FileNotFoundError:
            sock.close()
            if not os.path.isdir(os.path.dirname(path)) or time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        except OSError:  # refused: nothing listens there any more
            sock.close()
            return None


def catchable_signals() -> list[signal.Signals]:
    """The standard signals a process can handle or ignore (not SIGKILL, SIGSTOP, real-time ones)."""
    return [
        sig
        for sig in signal.valid_signals()
        if isinstance(sig, signal.Signals)
        and sig < signal.SIGRTMIN
        and sig not in (signal.SIGKILL, signal.SIGSTOP)
    ]


def default_handler(sig: int) -> Any:
    """What a new interpreter handles `sig` with: KeyboardInterrupt for SIGINT, else the OS's default."""
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def end_as(code: int) -> NoReturn:
    """Exit with `code` as waitstatus_to_exitcode gives it: negative means killed by that signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL's cannot be set, nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # a signal whose default is not to end the process
    os._exit(code)


def run_in_zygote(path: str, argv: list[str]) -> None:
    """Be the stub of a worker forked by the zygote at `path`; never returns once it has one.

    Returns (start cold, then) only when no zygote answers at `path`, or it answers `cold NAME`:
    the worker's `NAME` (read when a library loads) differs from what the zygote loaded under.
    """
    sock = _connect(path)
    if sock is None:
        return
    worker: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not worker:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(worker[0], signum)
            if signum != signal.SIGCONT and _stopped(worker[0]):  # frozen: let it act on the signal
                os.kill(worker[0], signal.SIGCONT)

    # What a cold worker would start with: the signals ignored in this new interpreter, started by
    # torch's agent as it starts a worker (the worker ignores the same ones), before the forwarding.
    ignored = [int(sig) for sig in catchable_signals() if signal.getsignal(sig) == signal.SIG_IGN]
    for sig in FORWARDED:
        signal.signal(sig, forward)
    fields = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored}
    request = json.dumps(fields).encode()
    try:
        socket.send_fds(sock, [REQUEST_HEADER.pack(len(request))], [0, 1, 2])
        sock.sendall(request)
    except OSError:
        sock.close()
        return
    reader = sock.makefile("r")
    line = reader.readline()
    if not line.startswith("pid "):  # `cold NAME`, or the zygote died before it forked: start cold
        sock.close()
        for sig in FORWARDED:
            signal.signal(sig, default_handler(sig))
        for signum in pending:
            os.kill(os.getpid(), signum)
        return
    worker.append(int(line.split()[1]))
    for signum in pending:
        forward(signum, None)
    line = reader.readline()
    if line.startswith("status "):
        end_as(int(line.split()[1]))
    end_as(-int(signal.SIGKILL))  # the zygote died, and the worker with it (its parent-death signal)

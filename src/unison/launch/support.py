"""Helpers of `unison launch`: option and network checks, the failure summary.

Nothing here supervises a process or forms a rendezvous (torch's elastic agent does both):
this module decides which interface gloo uses, checks a port before anything starts, and turns
torch's `ChildFailedError` into one summary. It imports no torch at module level, so bad options
are answered before torch loads (where each rank's output goes: `unison.launch.logs`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported only once a launch starts: option errors come first (fast)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from unison.launch.logs import RankLogsSpecs


class LaunchError(ValueError):
    """Bad launch options or environment, found before any process starts (one readable line)."""


# ---- options ---------------------------------------------------------------------------------
def parse_gpus(spec: str) -> tuple[int, ...]:
    """GPU ids from `--gpus` ("0,1" or "all"), checked against `torch.cuda.device_count()`."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise LaunchError(
            f"--gpus {spec}: this machine has no GPU (torch.cuda.device_count() is 0, torch "
            f"{torch.__version__}); use --nproc N to run N CPU processes"
        )
    if spec.strip().lower() == "all":
        return tuple(range(count))
    try:
        ids = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise LaunchError(f"--gpus {spec}: expected GPU ids like 0,1 or 'all'") from None
    absent = [i for i in ids if not 0 <= i < count]
    if not ids or absent or len(set(ids)) != len(ids):
        why = f"GPU {absent} not present" if absent else "ids must be distinct and non-empty"
        raise LaunchError(f"--gpus {spec}: {why}; this machine has {count} GPU(s): 0..{count - 1}")
    return ids


def parse_nnodes(spec: str, elastic: bool) -> tuple[int, int]:
    """`(min, max)` machines from `--nnodes` ("2", or "1:4" for an elastic rendezvous)."""
    try:
        lo, _, hi = spec.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {spec}: expected a number of machines (or MIN:MAX)") from None
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {spec}: needs 1 <= MIN <= MAX")
    if low != high and not elastic:
        raise LaunchError(f"--nnodes {spec}: a range needs an elastic rendezvous (--rdzv-endpoint H:P)")
    return low, high


# ---- network -----------------------------------------------------------------------------------
def resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """`host`'s first address (IPv4 preferred), or a `LaunchError` saying it does not resolve.

    >>> resolve("127.0.0.1")
    (<AddressFamily.AF_INET: 2>, '127.0.0.1')
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, *_, sockaddr = infos[0]
    return family, str(sockaddr[0])


def route_source(host: str, port: int = 9) -> str | None:
    """The local address this machine would use to reach `host` (a UDP `connect`: no packet is sent)."""
    try:
        family, addr = resolve(host)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return str(s.getsockname()[0])
    except (OSError, LaunchError):
        return None


def _ioctl_ipv4(name: str) -> str | None:
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface's addresses: `ip -o addr` where available, else SIOCGIFADDR (IPv4)."""
    found: dict[str, list[str]] = {}
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():  # "2: eth0    inet 10.0.0.5/24 brd ..."
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
                found.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    except (OSError, subprocess.SubprocessError):
        pass
    if not found and hasattr(socket, "if_nameindex"):
        for _, name in socket.if_nameindex():
            addr = _ioctl_ipv4(name)
            if addr:
                found.setdefault(name, []).append(addr)
    return found


def interface_for(host: str) -> tuple[str, str] | None:
    """`(interface name, local address)` that routes to `host`: what gloo should bind to.

    >>> interface_for("127.0.0.1")
    ('lo', '127.0.0.1')
    """
    source = route_source(host)
    if source is None:
        return None
    for name, addrs in interface_addresses().items():
        if source in addrs:
            return name, source
    return None


def default_route_interface() -> tuple[str, str] | None:
    """`(name, address)` of the interface of the IPv4 default route (read from /proc; no traffic)."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            addrs = interface_addresses().get(fields[0], [])
            return fields[0], (addrs[0] if addrs else "?")
    return None


def port_in_use(port: int) -> bool:
    """True when a TCP server already listens on `port` on this machine (tried by binding it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like TCPStore: TIME_WAIT is no conflict
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """Export `env` for the duration of the block (torch's agent passes os.environ to workers)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet_torch_logs(verbose: bool) -> None:
    """torch's agent logs every step at WARNING/ERROR; the summary says what matters."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if verbose else logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        if verbose:
            logger.setLevel(logging.INFO)


def unreadable_error_files(log_dir: str) -> list[tuple[int, Path]]:
    """`(rank, path)` of the latest attempt's error files that are empty or not whole JSON.

    torch's agent fails on one (`JSONDecodeError`) instead of reporting the rank and restarting:
    unison's workers write theirs whole or not at all, but a `--no-python` program may not.

    >>> unreadable_error_files("/tmp/logs")  # rank 1 was stopped while writing its error file
    [(1, PosixPath('/tmp/logs/attempt_0/rank1.error.json'))]
    """
    attempts = sorted(Path(log_dir).glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    found = []
    for error_file in sorted(attempts[-1].glob("rank*.error.json")) if attempts else []:
        try:
            json.loads(error_file.read_text())
        except ValueError:
            found.append((int(error_file.name.split(".")[0].removeprefix("rank")), error_file))
        except OSError:
            continue
    return found


# ---- failure summary ---------------------------------------------------------------------------
# Errors a rank raises because *another* rank went away: never the root cause when a better one exists.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL communicator was aborted",
)


def _message(failure: ProcessFailure) -> tuple[str, str]:
    """`(headline, traceback)` from the worker's error file, or empty strings."""
    msg: Any = failure.message
    if isinstance(msg, dict):
        return str(msg.get("message", "")), str(msg.get("extraInfo", {}).get("py_callstack", ""))
    if isinstance(msg, str) and os.path.isfile(failure.error_file):
        return msg, ""
    return "", ""


def is_peer_loss(failure: ProcessFailure) -> bool:
    """True when the failure reads like a consequence of another rank going away."""
    headline, stack = _message(failure)
    return any(p in headline or p in stack for p in _PEER_LOSS)


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


def _how(failure: ProcessFailure) -> tuple[str, int]:
    """("exit code 3", 3) or ("signal SIGKILL", 137)."""
    if failure.exitcode < 0:
        return f"signal {failure.signal_name()}", 128 - failure.exitcode
    return f"exit code {failure.exitcode}", failure.exitcode or 1


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended on this machine since boot (/proc/vmstat).

    >>> oom_kills()
    3
    """
    try:
        with open("/proc/vmstat") as fh:
            for line in fh:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def sigkill_cause(oom_before: int | None) -> str:
    """What a worker's SIGKILL most likely was: the OOM killer if it ended a process since
    `oom_before` (the count when the attempt started), else the usual senders.

    >>> sigkill_cause(3)  # /proc/vmstat's oom_kill is 4 now
    "killed by the kernel's OOM killer (out of memory): it ended 1 process on this machine during ..."
    """
    now = oom_kills()
    if now is not None and oom_before is not None and now > oom_before:
        return (
            f"killed by the kernel's OOM killer (out of memory): it ended {now - oom_before} process(es) on "
            "this machine during this attempt (/proc/vmstat oom_kill); dmesg names them"
        )
    return (
        "SIGKILL, exit status 137: sent by the kernel's OOM killer when memory runs out (dmesg says so), "
        "by kill -9, or by a scheduler's hard stop"
    )


def exit_phrase(exitcode: int, oom_before: int | None = None) -> str:
    """How a worker ended, in a few words: "exit code 1", "signal SIGKILL, killed by the kernel's OOM killer".

    >>> exit_phrase(-9, oom_before=None)
    'signal SIGKILL'
    """
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL and oom_before is not None:
        cause = sigkill_cause(oom_before)
        if cause.startswith("killed by"):
            return f"signal {name}, {cause.split(':')[0]}"
    return f"signal {name}"


def failure_summary(
    err: ChildFailedError, logs: RankLogsSpecs | None = None, log_dir: str | None = None, lines: int = 12
) -> tuple[str, int]:
    """One summary of a failed launch and the exit code to return.

    Names the root-cause rank, its exit code or signal, and the last `lines` of its traceback
    (from torch's error file; else the end of its stderr log). The exit code is the worker's
    own, or 128 + signal number for a worker killed by a signal (the shell's convention).
    """
    rank, failure = root_cause(err)
    how, code = _how(failure)
    headline, stack = _message(failure)
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
    others = [f"{r} ({_how(f)[0]})" for r, f in sorted(err.failures.items()) if r != rank]
    if others:
        out.append(f"  other ranks on this node that stopped or failed after it: {', '.join(others)}")
    if log_dir:
        out.append(f"  logs: {log_dir}")
    return "\n".join(out), code

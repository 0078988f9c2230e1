"""What the launcher watches beside torch's agent, so a frozen worker cannot hang a job, and the rendezvous it
chooses (`check_rdzv_endpoint`, `private_rendezvous_file`, `rdzv_store_configs`, `rdzv_failure_hint`).

- `WatchWorkers`: torch's agent stops the workers with SIGTERM and waits before SIGKILL; a
  stopped process keeps a SIGTERM pending and never acts on it. This thread continues (SIGCONT)
  a child that is stopped with a SIGTERM pending, so it ends at once. And a worker that dies
  (the OOM killer's SIGKILL) leaves its own children behind (DataLoader workers, which notice
  only seconds later): torch's agent signals a worker's process group only while the worker
  runs, so this thread ends what is left of a worker's session once the worker is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

from unison.distributed.deadline import within
from unison.distributed.network import UnresolvedHost, interface_addresses, port_in_use, resolve


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in task.read_text().split()]
    return found


def stopped_with_pending_term(pid: int) -> bool:
    """True when `pid` is stopped (state T) and a SIGTERM is pending for it (read from /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if not fields.get("State", "").strip().startswith("T"):
        return False
    term = 1 << (int(signal.SIGTERM) - 1)  # in the masks of pending signals, shared by the threads or not
    return any(int(fields.get(mask, "0").strip() or "0", 16) & term for mask in ("ShdPnd", "SigPnd"))


def _session_of(pid: int) -> int | None:
    """The session id of `pid` (from /proc/<pid>/stat), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])  # after "pid (comm)": state ppid pgrp session ...


def _launched_by(pid: int, launcher: int) -> bool:
    """True when `pid` has the variable `unison launch` exports to its workers (their children inherit it)."""
    from unison.env_names import LAUNCHER_PID_ENV

    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{LAUNCHER_PID_ENV}={launcher}".encode() in environ.split(b"\0")


def end_leftovers(sessions: set[int], launcher: int) -> list[int]:
    """SIGKILL every process still in one of `sessions` (the sessions of workers that have ended)
    that this launch started; return their pids."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if _session_of(pid) in sessions and _launched_by(pid, launcher):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


class WatchWorkers:
    """A thread beside torch's agent: it continues this process's stopped children once they are
    told to terminate, and ends what a worker leaves behind once the worker is gone.

    torch's agent starts every worker in a session of its own (its pid is the session id), so the
    processes left in it after the worker ended are the worker's own children.

        with WatchWorkers():
            launch_agent(config, sys.executable, args)
    """

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unison-watch-workers", daemon=True)
        self._workers: set[int] = set()  # children seen, each a session leader (torch's start_new_session)

    def __enter__(self) -> WatchWorkers:
        if os.path.isdir("/proc/self/task"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval)
        self._sweep(set(_children(os.getpid())))  # the agent has stopped its workers: nothing of them stays

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.interval):
            children = set(_children(me))
            for child in children:
                if stopped_with_pending_term(child):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(child, signal.SIGCONT)
            self._sweep(children)

    def _sweep(self, children: set[int]) -> None:
        """Remember the workers (children leading their own session); end what the gone ones left."""
        me = os.getpid()
        for child in children - self._workers:
            if _session_of(child) == child:
                self._workers.add(child)
        gone = self._workers - children
        if gone:
            self._workers -= gone
            end_leftovers(gone, me)


#: The key torch's c10d rendezvous backend creates first in its store (`C10dRendezvousBackend`).
RDZV_KEY_PREFIX = "torch.rendezvous."


def _probe_store(addr: str, port: int, key: str, wait: float) -> bool | None:
    """What listens at `addr:port`: None if it does not answer as a c10d TCPStore within `wait`
    s, else whether the store holds `key` (waited for up to `wait` s: the node hosting it may
    have just made it)."""
    import torch.distributed as dist

    def probe() -> bool:
        store = dist.TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=wait), wait_for_workers=False
        )
        deadline = time.monotonic() + wait
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return store.check([key])

    try:  # a client call has no bound of its own against a silent server
        return within(2 * wait + 1.0, probe, f"the store at {addr}:{port}")
    except Exception:
        return None


def is_local_address(addr: str) -> bool:
    """True when `addr` is loopback or one of this machine's interface addresses."""
    try:
        if ipaddress.ip_address(addr).is_loopback:
            return True
    except ValueError:
        return False
    return any(addr in addrs for addrs in interface_addresses().values())


def check_rdzv_endpoint(endpoint: str, run_id: str = "unison", wait: float = 3.0) -> None:
    """Fail fast when the elastic endpoint's port on this machine is held by anything but this
    job's rendezvous store: a program that is not a c10d store (torch's agent would wait on it
    forever), or another job's store (it would be joined, and the jobs mixed). A store holding
    rendezvous `run_id` is fine: another node of the same job, started on this machine, hosts it.

    >>> check_rdzv_endpoint("127.0.0.1:29400", run_id="7")  # LaunchError if another job holds 29400
    """
    from unison.launch.options import LaunchError

    host, _, port_text = endpoint.rpartition(":")
    _, addr = resolve(host.strip("[]"))
    port = int(port_text)
    if not is_local_address(addr) or not port_in_use(port):
        return  # another machine hosts it, or this node will
    ours = _probe_store(addr, port, RDZV_KEY_PREFIX + run_id, wait)
    if ours is None:
        raise LaunchError(
            f"--rdzv-endpoint {endpoint}: port {port} on this machine is held by a program that is not "
            f"a c10d rendezvous store (no answer as one within {wait:.0f} s): choose a free port"
        )
    if not ours:
        raise LaunchError(
            f"--rdzv-endpoint {endpoint}: port {port} on this machine is held by a c10d store that holds no "
            f"rendezvous {run_id!r} (another job's store): choose a free port, or this job's --rdzv-id"
        )


def private_rendezvous_file(run_id: str) -> str:
    """Create the one-machine rendezvous file, readable and writable by this user only (0600).

    torch's FileStore would create it under the umask (0644: any local user could read it).

        private_rendezvous_file("0f3c")
    """
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"unison-rendezvous-{run_id}")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def private_dir(path: str) -> str:
    """Make `path` (and nothing above it) a folder only this user can enter (0700)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # makedirs' mode is filtered by the umask, and skipped for an existing folder
    return path


def private_files(*paths: str) -> None:
    """Create empty files only this user can read (0600); torch then writes into them as they are."""
    for path in paths:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.chmod(path, 0o600)


def rdzv_store_configs(endpoint: str, timeout: int | None) -> dict[str, object]:
    """torch c10d rendezvous options that make the node owning the endpoint's address host the store.

    torch decides who hosts by comparing the endpoint with this machine's *hostname*, so cloned
    machines (same hostname, /etc/hosts pointing elsewhere) all decline, or all claim it. The
    address is what counts: `is_host` is True on the node with an interface holding it, False on
    the others. (Left to torch when it already agrees and the address is loopback, so two nodes
    started on one machine still settle it between themselves.) `timeout` bounds how long a node
    waits to reach the store, so a store nobody hosts fails the launch instead of hanging it.

        rdzv_store_configs("10.0.0.1:29400", 60)  # on the machine that has 10.0.0.1
    """
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host = endpoint.rpartition(":")[0].strip("[]")
    _, addr = resolve(host)
    configs: dict[str, object] = {"read_timeout": timeout} if timeout else {}
    owned = is_local_address(addr)
    if owned and ipaddress.ip_address(addr).is_loopback:
        return configs  # one machine: torch's own choice, with its fall-back to a client
    if owned != _matches_machine_hostname(host):
        configs["is_host"] = owned
    return configs


def rdzv_failure_hint(endpoint: str, ran: bool = False) -> str:
    """Why an elastic rendezvous at `endpoint` could not form or went away, as far as this node can
    tell; `ran`: this node's workers had started (the job was lost, not never formed)."""
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        _, addr = resolve(host)
    except UnresolvedHost as exc:
        return str(exc)
    if ran and is_local_address(addr):
        return (
            f"this node has {addr} and hosts the rendezvous store; the other nodes stopped answering after "
            "the workers started: a node went down, or the network between the nodes was cut"
        )
    if ran:
        return (
            f"the node that has the address {addr} hosts the rendezvous store, and it stopped answering "
            "after the workers started: that node went down, or the network to it was cut"
        )
    if is_local_address(addr):
        return f"this node has {addr} and hosted the rendezvous store: did the other nodes start?"
    return (
        f"the node that has the address {addr} hosts the rendezvous store, and none answered within "
        "the timeout: is it started, and does a machine of the job really have that address?"
    )

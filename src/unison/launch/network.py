"""The network a launch runs on: host names, this machine's interfaces and routes, free ports.

It decides which interface gloo uses (the one that routes to the rendezvous host) and checks a
port before anything starts. Standard library only: no torch, so bad options are answered fast.

>>> interface_for("127.0.0.1")
('lo', '127.0.0.1')
"""

from __future__ import annotations

import errno
import socket
import struct
import subprocess
from pathlib import Path

from unison.launch.options import LaunchError


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


class StorePortHold:
    """Choose each attempt's MASTER_PORT here and keep it bound until the next attempt.

    torch's agent picks a free port for the workers' store and closes it; rank 0 binds it seconds
    later (the workers' start), and on a busy machine another process (any connect() or bind)
    can take it in between: rank 0 fails with `[Errno 98] Address already in use` and an attempt
    is lost. Where this node's workers are the whole world, the port is chosen here instead and
    held by a socket that is bound but never listens, with SO_REUSEADDR: no other program can
    bind it or get it from the kernel, while rank 0's store (which sets SO_REUSEADDR too, as
    TCPStore does) binds it and listens. Across machines the port torch agreed is left as is.

    >>> hold = StorePortHold()
    >>> envs = {0: {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    ...         1: {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}}
    >>> hold.assign(envs)
    >>> envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == str(hold.port)
    True
    >>> hold.release()
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    @property
    def port(self) -> int | None:
        """The port held now, or None."""
        return self._sock.getsockname()[1] if self._sock is not None else None

    def assign(self, envs: dict[int, dict[str, str]]) -> None:
        """Give the workers of one attempt (`envs`: local rank -> environment) a held store port."""
        self.release()
        first = next(iter(envs.values()), None)
        if first is None or first.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return  # the agent's own store serves the workers: its port is not ours to change
        if first.get("WORLD_SIZE") != str(len(envs)) or "MASTER_PORT" not in first:
            return  # ranks on other machines read the port torch's rendezvous agreed
        v6 = ":" in first.get("MASTER_ADDR", "")
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if v6 else "", 0))  # every address: rank 0 may bind loopback or all of them
        self._sock = sock
        for env in envs.values():
            env["MASTER_PORT"] = str(self.port)

    def release(self) -> None:
        """Let the held port go (the attempt it was for is over)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

"""The network a job runs on: host names, this machine's interfaces and routes, free ports.

`unison launch` picks gloo's interface with it (the one that routes to the rendezvous host) and
checks a port before anything starts; a torchft replica names its host to the others with it
(`advertised_host`); `unison env` reports the default route. Standard library only: no torch,
so a launch's bad options are answered fast.

>>> interface_for("127.0.0.1")
('lo', '127.0.0.1')
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import subprocess
from pathlib import Path
from urllib.parse import urlparse


class UnresolvedHost(ValueError):
    """A host name that does not resolve (one readable line; `unison launch` reports it as a bad option)."""


def resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """`host`'s first address (IPv4 preferred), or `UnresolvedHost` saying it does not.

    >>> resolve("127.0.0.1")
    (<AddressFamily.AF_INET: 2>, '127.0.0.1')
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise UnresolvedHost(f"cannot resolve host {host!r}: {exc.strerror}") from None
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
    except (OSError, UnresolvedHost):
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


def store_listener(host: str, port: int = 0) -> socket.socket:
    """A socket listening on `host` alone (`port` 0: any free one), for a TCPStore server to take
    (`master_listen_fd`): a TCPStore left to bind itself listens on every interface.

    >>> with store_listener("127.0.0.1") as sock:
    ...     sock.getsockname()[0]
    '127.0.0.1'
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def reach_host(lighthouse: str | None) -> str | None:
    """The host of a lighthouse address `http://host:port` unless it is this machine's loopback.

    >>> reach_host("http://10.0.0.1:29510"), reach_host("http://127.0.0.1:29510")
    ('10.0.0.1', None)
    """
    host = urlparse(lighthouse).hostname if lighthouse else None
    if not host:
        return None
    try:
        addr = resolve(host)[1]
    except UnresolvedHost:
        return None
    return None if ipaddress.ip_address(addr).is_loopback else host


def advertised_host(lighthouse: str | None) -> str:
    """The name or address this process gives the other replicas to reach it: its address on the
    route to the lighthouse when that is over a network, else the host name (one machine)."""
    there = reach_host(lighthouse)
    found = interface_for(there) if there else None
    return found[1] if found else socket.gethostname()

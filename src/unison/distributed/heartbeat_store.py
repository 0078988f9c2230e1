"""The store the ranks' watchdogs publish their progress to (`distributed.watchdog`), hosted outside
the workers: by `unison launch` (the agent's process) on one machine, and by `unison.spawn`'s caller.
Not in rank 0: a rank that freezes (SIGSTOP, swapped out, D-state) must not take the store the
others diagnose it with down with it.

    with heartbeat_store() as env:
        env["UNISON_HEARTBEAT_STORE"]   # "127.0.0.1:<a free port>", exported for the workers
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from unison.env_names import HEARTBEAT_ENV

__all__ = ["heartbeat_store"]


def _listener(host: str) -> socket.socket:
    """A listening socket on `host`, any free port (loopback stays loopback: nothing else can reach it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    return sock


@contextlib.contextmanager
def heartbeat_store(host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """Host the heartbeat store in this process for the block; yield the variables workers need.

    For example:

        with heartbeat_store() as env:
            env["UNISON_HEARTBEAT_STORE"]   # "127.0.0.1:<a free port>"
    """
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"the heartbeat store listens on loopback only, got {host}")
    sock = _listener(host)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        master_listen_fd=sock.detach(),  # bound to loopback: a TCPStore alone binds every interface
    )
    try:
        yield {HEARTBEAT_ENV: f"{host}:{port}"}
    finally:
        del store

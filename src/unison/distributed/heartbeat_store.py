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
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from unison.distributed.network import store_listener
from unison.env_names import HEARTBEAT_ENV

__all__ = ["heartbeat_store"]


@contextlib.contextmanager
def heartbeat_store(host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """Host the heartbeat store in this process for the block; yield the variables workers need.

    For example:

        with heartbeat_store() as env:
            env["UNISON_HEARTBEAT_STORE"]   # "127.0.0.1:<a free port>"
    """
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"the heartbeat store listens on loopback only, got {host}")
    sock = store_listener(host)  # loopback stays loopback: nothing else can reach it
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        master_listen_fd=sock.detach(),
    )
    try:
        yield {HEARTBEAT_ENV: f"{host}:{port}"}
    finally:
        del store

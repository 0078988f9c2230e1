"""torchft's lighthouse, started in this process: the coordinator replicas ask which of them take
part in each step. Light on purpose (torchft loads when one starts): `unison lighthouse` and
`unison launch --start-lighthouse` (`unison.launch.lighthouse`) start it from here, and tests and
notebooks call `start_lighthouse` directly.

>>> lighthouse = start_lighthouse(min_replicas=2)                     # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_lighthouse"]


def start_lighthouse(
    min_replicas: int = 1,
    port: int = 0,
    join_timeout_ms: int = 2000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """Start torchft's lighthouse in this process (the `torchft_lighthouse` binary does the same);
    its `address()` is what replicas need in `TORCHFT_LIGHTHOUSE`. Call `shutdown()` when done.

    >>> lighthouse = start_lighthouse(min_replicas=2)                     # doctest: +SKIP
    >>> os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()           # doctest: +SKIP
    """
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )

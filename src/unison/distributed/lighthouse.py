"""torchft's lighthouse, started in this process: the coordinator replicas ask which of them take
part in each step. Light on purpose (torchft loads when one starts): `unison lighthouse` and
`unison launch --start-lighthouse` (`unison.launch.lighthouse`) start it from here, and tests and
notebooks call `start_lighthouse` directly.

    lighthouse = start_lighthouse(min_replicas=2)
"""

from __future__ import annotations

from typing import Any

__all__ = ["HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS", "QUORUM_TICK_MS", "start_lighthouse"]

#: torchft's lighthouse timings unless told (ms): how long a quorum waits for replicas that were in
#: the last one (after a loss, most of the survivors' stall), how often it checks, and how long a
#: replica may stay silent before it counts as gone.
JOIN_TIMEOUT_MS, QUORUM_TICK_MS, HEARTBEAT_TIMEOUT_MS = 2000, 100, 5000


def start_lighthouse(
    min_replicas: int = 1,
    port: int = 0,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
    quorum_tick_ms: int = QUORUM_TICK_MS,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
) -> Any:
    """Start torchft's lighthouse in this process (the `torchft_lighthouse` binary does the same);
    its `address()` is what replicas need in `TORCHFT_LIGHTHOUSE`. Call `shutdown()` when done.

        lighthouse = start_lighthouse(min_replicas=2)
        os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
    """
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )

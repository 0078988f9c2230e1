"""Another process takes the workers' store port before rank 0 binds it (the race of a loaded machine).

Rank 1 plays the other process: it binds MASTER_PORT as any program would (no SO_REUSEADDR) and
listens on it, then says so in a file; rank 0 waits for that file before it hosts the store. The
launcher holds the port from its choice until the attempt ends, so the thief must be refused.

stdout: `THIEF {"errno": N or null}` (rank 1), `SUM {"value": ...}` (rank 0, after an all-reduce).
(`tests/launch/test_spawn.py` runs `take_the_store_port` under `unison.spawn`.)
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

#: The thief's socket, kept open (listening) for the rest of the process.
HELD: list[socket.socket] = []


def take_the_store_port(rank: int, port: int, flag: Path) -> int | None:
    """Rank 1: bind and listen on `port`, return the errno that refused it (None: taken); then
    touch `flag`. Every other rank waits (up to 60 s) for `flag` and returns None."""
    if rank != 1:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    refused = None
    try:
        thief.bind(("127.0.0.1", port))
        thief.listen(1)
        HELD.append(thief)
    except OSError as exc:
        refused = exc.errno
    flag.write_text("tried")
    return refused


if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    from unison.distributed import setup_distrib

    rank = int(os.environ["RANK"])
    taken = take_the_store_port(rank, int(os.environ["MASTER_PORT"]), Path(sys.argv[1]))
    if rank == 1:
        print("THIEF " + json.dumps({"errno": taken}), flush=True)
    setup_distrib()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    if rank == 0:
        print("SUM " + json.dumps({"value": total.item()}), flush=True)
    dist.destroy_process_group()

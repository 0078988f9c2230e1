"""Another process takes the workers' store port before rank 0 binds it (the race of a loaded machine).

Rank 1 plays the other process: it binds MASTER_PORT as any program would (no SO_REUSEADDR) and
listens on it, then says so in a file; rank 0 waits for that file before it hosts the store. The
launcher holds the port from its choice until the attempt ends, so the thief must be refused.

stdout: `THIEF {"errno": N or null}` (rank 1), `SUM {"value": ...}` (rank 0, after an all-reduce).
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from unison.distributed import setup_distrib

flag = Path(sys.argv[1])
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
if rank == 1:
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        thief.bind(("127.0.0.1", port))
        thief.listen(1)
        taken = None
    except OSError as exc:
        taken = exc.errno
    print("THIEF " + json.dumps({"errno": taken}), flush=True)
    flag.write_text("tried")
else:
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
setup_distrib()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if rank == 0:
    print("SUM " + json.dumps({"value": total.item()}), flush=True)
dist.destroy_process_group()

"""Launch failure modes. `fail.py MODE PIDDIR`: rank 1 fails as MODE says, rank 0 waits to be stopped.

MODE: raise (ValueError), kill (SIGKILL itself), exit3 (sys.exit(3)),
restart (raises on the first attempt only, then every rank succeeds).
Every worker writes its pid to PIDDIR/pid<rank> first.
"""

import os
import signal
import sys
import time

mode, piddir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(os.path.join(piddir, f"pid{rank}.{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w") as fh:
    fh.write(str(os.getpid()))
if mode == "restart":
    if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("rank 1 fails on the first attempt")
    print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} done")
    sys.exit(0)
if rank != 1:
    time.sleep(120)  # the launcher must stop this rank once rank 1 fails
elif mode == "raise":

    def load_batch():
        raise ValueError("boom from rank 1: bad batch 7")

    load_batch()
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "exit3":
    print("giving up with status 3", file=sys.stderr)
    sys.exit(3)

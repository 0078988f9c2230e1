"""Launch failure modes. `fail.py MODE PIDDIR`: rank 1 fails as MODE says, rank 0 waits to be stopped.

MODE: raise (ValueError), kill (SIGKILL itself), exit3 (sys.exit(3)), interrupt (SIGINT, as
Ctrl-C, after both ranks joined a gloo group: torch's excepthook is installed).
Every worker writes its pid to PIDDIR/pid<rank> first; rank 1 fails once rank 0 has.
"""

import os
import signal
import sys
import time

mode, piddir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "interrupt":
    import torch.distributed as dist

    dist.init_process_group("gloo")
with open(os.path.join(piddir, f"tmp{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
os.replace(os.path.join(piddir, f"tmp{rank}"), os.path.join(piddir, f"pid{rank}"))  # whole, or absent
deadline = time.monotonic() + 30
while rank == 1 and not os.path.exists(os.path.join(piddir, "pid0")) and time.monotonic() < deadline:
    time.sleep(0.05)  # fail only once rank 0 runs, so the test knows every pid it must see stopped
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
elif mode == "interrupt":

    def train_step():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the KeyboardInterrupt arrives here

    train_step()

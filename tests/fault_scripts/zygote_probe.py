"""What a `unison launch` worker sees of its own process, written to OUT/rank<R>.attempt<A>.json.

zygote_probe.py OUT ok|exit3|sigkill|hold   (rank 1: exits 3, SIGKILLs itself, or waits on attempt 0)
"""

import json
import logging
import os
import random
import signal
import sys
import time

preloaded = "torch._dynamo" in sys.modules  # imported before this script ran: warm (launch.zygote.PRELOAD)
# What the zygote preloads beyond torch (launch.zygote.PRELOAD): dynamo, which loads FSDP and DTensor;
# a cold worker has none of them before its script runs.
inherited = [
    m for m in ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor") if m in sys.modules
]
import numpy as np  # noqa: E402
import torch  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
range_of_signals = [sig for sig in signal.valid_signals() if sig < signal.SIGRTMIN]
rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
record = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "file": __file__,
    "path0": sys.path[0],
    "preloaded": preloaded,
    "inherited": inherited,
    "env": sorted(os.environ),
    "torch": torch.rand(4).tolist(),
    "numpy": np.random.rand(4).tolist(),
    "random": random.random(),
    # how each signal is handled: a new interpreter ignores SIGPIPE and SIGXFSZ, and so must a fork
    "signals": {sig.name: getattr(signal.getsignal(sig), "name", "a handler") for sig in range_of_signals},
    "parent": open(f"/proc/{os.getppid()}/cmdline").read().split("\0"),
    "elastic_log": [  # the launcher quiets torch's agent loggers; a worker must not inherit that
        (len(log.handlers), log.propagate, log.level)
        for log in map(logging.getLogger, ("torch.distributed.elastic", "torch.distributed.launcher"))
    ],
}
with open(os.path.join(out, f"rank{rank}.attempt{attempt}.json"), "w") as fh:
    json.dump(record, fh)
if rank == "1" and mode == "exit3":
    sys.exit(3)
if rank == "1" and mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if rank == "1" and mode == "hold" and attempt == "0":
    time.sleep(120)  # until the test kills this rank's process as torch's agent knows it

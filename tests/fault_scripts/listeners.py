"""Prints every TCP port this worker and its launcher listen on, from inside a training group."""

import os
import subprocess

from unison.distributed import rank_distrib, setup_distrib

setup_distrib()
# this worker, its parent (the launch's zygote, or torch's agent when started cold) and the launcher
pids = {os.getpid(), os.getppid(), int(os.environ["UNISON_LAUNCHER_PID"])}
out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
for line in out.splitlines():
    if any(f"pid={pid}," in line for pid in pids):
        print(f"LISTEN rank{rank_distrib()} {line.split()[3]}", flush=True)

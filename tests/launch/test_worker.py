"""The worker bootstrap ends a script's process the way Python would, minus finalization.

Each case runs `python -m unison.launch.worker script` (what torch's agent runs for every rank)
as a real subprocess and checks what Python's own exit would have done.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.hangs import run_or_report
from tests.worker_pool import free_port

SCRIPT = """
import atexit, sys, threading, time

log = open(sys.argv[1], "w")  # a global file the script never closes
log.write("written, never flushed nor closed\\n")

def late_writer():
    time.sleep(0.3)
    with open(sys.argv[1] + ".thread", "w") as fh:
        fh.write("the thread finished\\n")

threading.Thread(target=late_writer).start()  # not a daemon: exit waits for it
atexit.register(lambda: print("atexit handler ran", flush=True))
print("script body ran")  # left in the buffer: stdout is a pipe here
how = sys.argv[2]
if how == "message":
    sys.exit("stopped: bad configuration")
if how == "status":
    sys.exit(7)
if how == "error":
    raise ValueError("broken on purpose")
"""


def run_worker(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "unison.launch.worker", str(script), str(out), how]
    return run_or_report(cmd, 60)


@pytest.mark.parametrize(
    ("how", "status", "stderr_has"),
    [
        ("normal", 0, ""),
        ("message", 1, "stopped: bad configuration"),
        ("status", 7, ""),
        ("error", 1, "ValueError: broken on purpose"),
    ],
)
@pytest.mark.procs
def test_the_end_of_a_script_is_pythons(tmp_path: Path, how: str, status: int, stderr_has: str) -> None:
    proc = run_worker(tmp_path, how)
    assert proc.returncode == status, proc.stderr
    assert stderr_has in proc.stderr
    # What Python's exit does, in its order: threads joined, atexit run, files and console flushed.
    assert proc.stdout.splitlines() == ["script body ran", "atexit handler ran"]
    assert (tmp_path / "out.txt").read_text() == "written, never flushed nor closed\n"
    assert (tmp_path / "out.txt.thread").read_text() == "the thread finished\n"


@pytest.mark.procs
def test_the_bootstrap_leaves_torchs_state_to_the_script(tmp_path: Path) -> None:
    """A plain torch script inherits no FSDP/DTensor/checkpoint imports from its launcher.

    With them loaded by the bootstrap, the torch tutorial's DDP script deadlocked at exit in
    torch's gloo group destructor about 1 launch in 3 (0 in 12 without; pytorch/pytorch#56297).
    """
    script = tmp_path / "probe.py"
    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    script.write_text(f"import sys\nprint([m for m in {heavy!r} if m in sys.modules])\n")
    proc = run_or_report([sys.executable, "-m", "unison.launch.worker", str(script)], 60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


KEEPER_SCRIPT = """
import gc, json, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from unison.launch.group_keeper import kept_groups

def made_and_freed():
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    ddp = DDP(torch.nn.Linear(4, 1))
    ddp(torch.ones(2, 4)).sum().backward()  # an allreduce started inside backward
    deadline = time.monotonic() + 30  # the keeper looks every 20 ms
    while not any(g is world for g in kept_groups()) and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()  # as pytorch/examples' tutorial: the group first, DDP after
    del ddp
    gc.collect()
    return id(world)

made = [made_and_freed(), made_and_freed()]  # a second group after the first was destroyed
print(json.dumps({"made": made, "kept": [id(g) for g in kept_groups()], "live": dist.is_initialized()}))
"""


@pytest.mark.procs
def test_the_bootstrap_keeps_each_default_group_past_destroy_so_freeing_ddp_cannot_deadlock(
    tmp_path: Path,
) -> None:
    """launch.group_keeper: freeing DDP after `destroy_process_group()` could run torch's gloo
    destructor from DDP's Reducer, which deadlocked there (pytorch/pytorch#56297: the torch
    tutorial hung 4 launches in 20 with dynamo preloaded, 0 in 20 with the keeper). Each group
    the script makes is still held after the script destroyed it and freed its DDP."""
    script = tmp_path / "keeper.py"
    script.write_text(KEEPER_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    proc = run_or_report([sys.executable, "-m", "unison.launch.worker", str(script)], 90, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["live"] is False  # both destroyed, as the script asked: deregistered from torch
    assert seen["kept"] == seen["made"] and len(set(seen["made"])) == 2  # and both still held


POOL_SCRIPT = """
import atexit, concurrent.futures, threading

POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # a module global, as libraries keep them


def double(x):  # a function of the script: its globals (POOL) live until the process ends
    return 2 * x


print("pool result", POOL.submit(double, 21).result(), flush=True)
release = threading.Event()


def waiter():
    release.wait()
    print("waiter released by threading's exit hook", flush=True)


threading.Thread(target=waiter).start()  # not a daemon: only the hook below ends it
threading._register_atexit(release.set)  # how concurrent.futures stops its pools at exit
atexit.register(lambda: print("atexit: threads left", [t.name for t in threading.enumerate()]))
"""


@pytest.mark.procs
def test_threading_exit_hooks_run_before_the_threads_are_joined(tmp_path: Path) -> None:
    """A pool in a module global (torch.compile's inductor keeps one) no longer hangs the worker.

    CPython runs `threading._register_atexit` hooks (concurrent.futures wakes and stops its
    idle workers there), then joins the non-daemon threads, then runs `atexit`. The bootstrap
    joined first: the pool's workers waited for work forever, and so did the worker process.
    """
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert python.returncode == 0, python.stderr
    expected = [
        "pool result 42",
        "waiter released by threading's exit hook",
        "atexit: threads left ['MainThread']",
    ]
    assert python.stdout.splitlines() == expected  # what the interpreter itself does
    worker = run_or_report([sys.executable, "-m", "unison.launch.worker", str(script)], 60)
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.splitlines() == expected


COMPILED_SCRIPT = """
import json, sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner
from unison.distributed import num_distrib, rank_distrib

SCALE = float(sys.argv[1])  # new in every test run: inductor compiles afresh (its pool starts)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x * SCALE)


torch.manual_seed(0)
x, y = torch.randn(32, 4), torch.randn(32, 1)
model = Scaled()
bs = 16 // num_distrib()  # global batch 16: 2 steps an epoch
dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs), None)
learn = Learner(dls, model, nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.1, compile=True)
with learn.distrib_ctx():
    learn.fit(1)
if rank_distrib() == 0:
    print("WEIGHTS " + json.dumps([p.tolist() for p in model.parameters()]), flush=True)
"""


@pytest.mark.launch
def test_a_compiled_model_trains_and_exits_under_launch(tmp_path: Path) -> None:
    """torch.compile (inductor, with its compile thread pool) on 2 processes: right weights, prompt exit.

    Before the fix, rank 0 printed its weights and then never exited (issue 18 item 4).
    """
    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_SCRIPT)
    scale = 1 + random.random()
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"}  # the pool even on a 1-core machine
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(script), repr(scale)]
    start = time.monotonic()
    proc = run_or_report(cmd, 100, env=env)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "WEIGHTS " in ln)
    weight, bias = (torch.tensor(v) for v in json.loads(line.split("WEIGHTS ", 1)[1]))
    # The same training by hand, eager, one process on the global batch.
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    ref = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in (0, 16):
        torch.nn.functional.mse_loss(ref(x[i : i + 16] * scale), y[i : i + 16]).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(weight, ref.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias, ref.bias.detach(), rtol=1e-5, atol=1e-6)
    assert took < 100

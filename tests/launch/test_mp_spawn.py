"""`unison.mp_spawn`: torch.multiprocessing.spawn's form (the PyTorch DDP primer's), the process index first.

The worker below is written for `mp.spawn` (index first, the group made by the script with
env://) and runs unchanged under `unison.mp_spawn`; the weights it trains equal a plain
single-process loop over the whole batch. (Module-level: spawned workers import it from here.)
"""

import inspect
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from unison import mp_spawn

STEPS = 3


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def main_worker(gpu, ngpus_per_node, out_dir):
    """The primer's worker shape: the index first, the group made by the script with env://."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=gpu, world_size=ngpus_per_node)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    part = slice(gpu * 8, gpu * 8 + 8)  # each process its half of the batch
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        opt.step()
    with open(os.path.join(out_dir, f"{gpu}.txt"), "w") as fh:
        fh.write(f"{gpu} {dist.get_rank()} {os.environ.get('RANK', '-')}")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    dist.destroy_process_group()
    return flat


@pytest.mark.procs
def test_mp_spawn_runs_primer_workers_with_the_index_first(tmp_path):
    assert inspect.signature(mp_spawn).parameters.keys() == inspect.signature(mp.spawn).parameters.keys()
    # spawn, not fork: forking a pytest process that has run OpenMP and gloo threads can deadlock.
    weights = mp_spawn(main_worker, nprocs=2, args=(2, str(tmp_path)), start_method="spawn")
    lines = sorted(p.read_text() for p in tmp_path.iterdir())
    assert lines == ["0 0 0", "1 1 1"]  # index first; it is the group rank and unison's RANK
    torch.manual_seed(0)
    model = nn.Linear(4, 1)  # one process, the whole batch: what DDP over the halves computes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((weights - expected).abs().max()) < 1e-6  # rank 0's result comes back


def test_mp_spawn_refuses_join_false_before_starting_anything():
    with pytest.raises(ValueError, match="join=False is not supported"):
        mp_spawn(main_worker, args=(2, "/nonexistent"), nprocs=2, join=False)


# Under `unison launch`, the worker spawns 2 processes that report their intra-op thread counts.
THREADS_SCRIPT = """
import os, sys
import torch
from unison import mp_spawn


def report(index, folder):
    with open(os.path.join(folder, f"child{index}"), "w") as fh:
        fh.write(str(torch.get_num_threads()))


if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], "worker"), "w") as fh:
        fh.write(str(torch.get_num_threads()))
    mp_spawn(report, nprocs=2, args=(sys.argv[1],))
"""


@pytest.mark.launch
@pytest.mark.parametrize("user_threads", [None, "3"])
def test_processes_spawned_by_a_launched_worker_divide_its_share_of_the_cores(tmp_path, user_threads):
    """`unison launch --nproc 1` gives its one worker every core; the 2 processes that worker spawns
    each inherited that count (2 + 2 threads on 2 cores). They divide it now; a count the user set
    (OMP_NUM_THREADS=3) is per process, as given."""
    import sys

    from tests.hangs import run_or_report
    from unison.distributed.env import usable_cores

    cores = usable_cores()
    if cores < 2 and user_threads is None:
        pytest.skip("one core: nothing to divide")
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_threads is not None:
        env["OMP_NUM_THREADS"] = user_threads
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "1", str(script), str(tmp_path)]
    done = run_or_report(cmd, 120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    worker = int((tmp_path / "worker").read_text())
    children = sorted(int((tmp_path / f"child{i}").read_text()) for i in range(2))
    if user_threads is None:
        # The launcher's rule: cores / 1 process, shared with other launches running here (a
        # parallel test run's), as its start line says.
        given = int(re.search(r"; (\d+) thread\(s\) each", done.stderr).group(1))
        assert worker == given and given <= cores
        assert children == [max(1, given // 2)] * 2  # the worker's share, divided between its 2
    else:
        assert worker == 3 and children == [3, 3]

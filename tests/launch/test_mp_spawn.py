"""`unison.mp_spawn`: torch.multiprocessing.spawn's form (seed 003), the process index first.

The worker below is written for `mp.spawn` (index first, the group made by the script with
env://) and runs unchanged under `unison.mp_spawn`; the weights it trains equal a plain
single-process loop over the whole batch. (Module-level: spawned workers import it from here.)
"""

import inspect
import os

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
    """Seed 003's worker shape: the index first, the group made by the script with env://."""
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
def test_mp_spawn_runs_seed003_workers_with_the_index_first(tmp_path):
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

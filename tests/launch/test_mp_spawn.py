"""`unison.mp_spawn`: torch.multiprocessing.spawn's form (seed 003), the process index first.

The same worker function runs under torch's `mp.spawn` and under `unison.mp_spawn`; both must
train the same weights. (Module-level functions: spawned workers import them from here.)
"""

import hashlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from unison import mp_spawn

pytestmark = pytest.mark.slow  # real processes


def main_worker(gpu, ngpus_per_node, out_dir):
    """Seed 003's worker shape: the index first, the group made by the script with env://."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=gpu, world_size=ngpus_per_node)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    for _ in range(3):
        part = slice(gpu * 8, gpu * 8 + 8)  # each process its half of the batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    with open(os.path.join(out_dir, f"{gpu}.txt"), "w") as fh:
        fh.write(f"{gpu} {dist.get_rank()} {os.environ.get('RANK', '-')} {digest}")
    dist.destroy_process_group()
    return digest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(out_dir):
    return sorted((out_dir / f).read_text() for f in os.listdir(out_dir))


def test_mp_spawn_runs_seed003_workers_as_torch_does(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "unison", tmp_path / "torch"
    ours.mkdir()
    theirs.mkdir()
    digest = mp_spawn(main_worker, nprocs=2, args=(2, str(ours)), start_method="fork")  # (faster)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # mp.spawn's users set these themselves
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    # (mp.spawn itself with fork: torch's start_processes, the same calling convention)
    assert mp.start_processes(main_worker, args=(2, str(theirs)), nprocs=2, start_method="fork") is None
    a, b = _results(ours), _results(theirs)
    assert [line.split()[:2] for line in a] == [["0", "0"], ["1", "1"]]  # index first, == the rank
    assert [line.split()[2] for line in a] == ["0", "1"]  # and unison's RANK agrees with it
    digests = {line.split()[3] for line in a + b}
    assert digests == {digest}  # every process, under either, trained the same weights


def test_mp_spawn_refuses_join_false_before_starting_anything():
    with pytest.raises(ValueError, match="join=False is not supported"):
        mp_spawn(main_worker, args=(2, "/nonexistent"), nprocs=2, join=False)

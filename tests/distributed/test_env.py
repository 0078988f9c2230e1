import pytest
import torch.distributed as dist

from tests.worker_pool import free_port
from unison.distributed.env import DistribEnv, local_rank, num_distrib, rank_distrib


def test_outside_a_launch_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (rank_distrib(), num_distrib(), local_rank()) == (0, 1, 0)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, 1)),
        (  # a task srun started (a batch script's SLURM_PROCID alone is not one: test_slurm.py)
            {
                "SLURM_PROCID": "2",
                "SLURM_STEP_NUM_TASKS": "8",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_NODELIST": "n1",
            },
            (2, 8, 0),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
            (1, 2, 1),
        ),
    ],
)
def test_launcher_variables(env, expected):
    e = DistribEnv.from_environ(env)
    assert (e.rank, e.world_size, e.local_rank) == expected


def test_rank_outside_world_is_a_clear_error():
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4"):
        DistribEnv.from_environ({"RANK": "4", "WORLD_SIZE": "4"})


def _ranks_from_group():
    return rank_distrib(), num_distrib()


def test_group_wins_over_environment(pool2):
    # The pool's workers export RANK/WORLD_SIZE too; a user-made group answers either way.
    assert pool2.run(_ranks_from_group) == [(0, 2), (1, 2)]
    assert free_port() > 0 and not dist.is_initialized()


def test_threads_share_the_cores():
    from unison.distributed.env import threads_per_worker

    assert threads_per_worker(2, cores=16) == 8
    assert threads_per_worker(3, cores=16) == 5
    assert threads_per_worker(4, cores=2) == 1


def _anon_huge_kb(env: dict) -> int:
    """A fresh interpreter fills a 64 MB tensor; its AnonHugePages (kB) as the kernel counts them."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "t = torch.ones(16 * 2**20)\n"
        "print(next(l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')).split()[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    return int(out.stdout.strip())


@pytest.mark.procs
def test_the_launchers_huge_pages_setting_backs_large_tensors_with_huge_pages(monkeypatch):
    # What `unison launch` exports (huge_pages_env) is a setting torch honours: a 64 MB tensor lands
    # on 2 MB pages with it, not without (THP in the kernel's `madvise` mode, this project's machines).
    from pathlib import Path

    from unison.distributed.env import huge_pages_env

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("the kernel's transparent huge pages are not in madvise mode here")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    exported = huge_pages_env()
    assert exported == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert _anon_huge_kb(exported) >= 32 * 1024  # most of the 64 MB on huge pages
    assert _anon_huge_kb({"THP_MEM_ALLOC_ENABLE": "0"}) < 8 * 1024
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert huge_pages_env() == {}  # the user's setting wins

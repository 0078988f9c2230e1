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

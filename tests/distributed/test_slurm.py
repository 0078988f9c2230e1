"""SLURM without a launcher: `srun python train.py` tasks find their place from SLURM's variables.

No SLURM runs here: the tests give real processes exactly the variables srun sets for the tasks
of a step (and a batch script or an salloc shell the ones they carry), and check the host-list
forms SLURM writes against hand-expanded lists."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker_pool import free_port
from unison.distributed.env import DistribEnv
from unison.distributed.slurm import expand_hostlist, is_srun_task, job_port

TRAIN = str(Path(__file__).resolve().parent.parent / "scripts" / "train_tiny.py")


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("n[001-003,007]", ["n001", "n002", "n003", "n007"]),
        ("alpha,beta", ["alpha", "beta"]),
        ("linux[1,2]", ["linux1", "linux2"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1-2],b[09-10],login", ["a1", "a2", "b09", "b10", "login"]),
        ("node7", ["node7"]),
    ],
)
def test_every_host_list_form_slurm_writes(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_a_malformed_host_list_is_a_clear_error():
    with pytest.raises(ValueError, match="unclosed bracket"):
        expand_hostlist("n[1-3")
    with pytest.raises(ValueError, match="lo <= hi"):
        expand_hostlist("n[5-3]")


def srun_env(rank, world=4, per_node=2, job="4242", **extra):
    """What srun sets for task `rank` of `srun -N 2 --ntasks-per-node=2` in job `job`."""
    env = {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": "cn[07-08]",
        "SLURM_STEP_NODELIST": "cn[07-08]",
        "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_STEP_ID": "0",
    }
    env.update(extra)
    return env


def test_an_srun_task_reads_rank_world_local_rank_and_rank_0s_host():
    e = DistribEnv.from_environ(srun_env(3))
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (3, 4, 1, 2)
    assert (e.master_addr, e.master_port) == ("cn07", job_port({"SLURM_JOB_ID": "4242"})) == ("cn07", 19242)
    own = DistribEnv.from_environ(srun_env(3, MASTER_ADDR="10.0.0.1", MASTER_PORT="29400"))
    assert (own.master_addr, own.master_port) == ("10.0.0.1", 29400)


def test_a_batch_script_an_salloc_shell_and_torchrun_inside_a_job_are_not_srun_tasks():
    """The classic mis-detection: the batch script carries SLURM_PROCID=0 and SLURM_NTASKS=8; read as
    rank 0 of 8 it waits at rendezvous for 7 processes that never come."""
    batch = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-4]"}
    salloc = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-4]"}
    for env in (batch, salloc):
        assert not is_srun_task(env)
        assert DistribEnv.from_environ(env).world_size == 1
    torchrun = srun_env(0, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="h", MASTER_PORT="1")
    assert not is_srun_task(torchrun)
    assert (DistribEnv.from_environ(torchrun).rank, DistribEnv.from_environ(torchrun).world_size) == (5, 8)


def _run(cmd, env, timeout=120):
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]


@pytest.mark.procs
def test_two_srun_tasks_without_a_launcher_train_as_one_process(tmp_path):
    """`srun --ntasks=2 python train.py`, simulated: two processes given only srun's variables form
    the group themselves and end on the weights of one process at the same global batch."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    base.pop("LOCAL_RANK", None)
    port = free_port()
    tasks = []
    for rank in range(2):
        env = dict(base, **srun_env(rank, world=2, per_node=2, job=str(port - 15000)))
        env.update(SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost", UNISON_TIMEOUT="60")
        tasks.append(_run([sys.executable, TRAIN, "--bs", "8"], env))
    (two,) = [r for t in tasks for r in _result(t)]
    (one,) = _result(_run([sys.executable, TRAIN, "--bs", "16"], base))
    assert two["weights"] == pytest.approx(one["weights"], rel=1e-6)
    assert two["valid"] == pytest.approx(one["valid"], abs=1e-6)


def test_one_launcher_per_node_takes_the_machines_and_node_0_from_slurm(monkeypatch, tmp_path):
    """`srun --ntasks-per-node=1 unison launch --nproc-per-node 2 train.py` on 2 nodes, simulated:
    the launcher of node 1 finds 2 machines, its rank 1, and node 0's host and the job's port."""
    from unison.launch.launcher import parse_options
    from unison.launch.options import LaunchError

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for name in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))]:
        monkeypatch.delenv(name)
    step = dict(srun_env(1, world=2, per_node=1), SLURM_STEP_NUM_NODES="2", SLURM_NODEID="1")
    step.update(SLURM_JOB_NODELIST="localhost,cn08", SLURM_STEP_NODELIST="localhost,cn08")
    for k, v in step.items():
        monkeypatch.setenv(k, v)
    opts = parse_options(["--nproc-per-node", "2", str(script)])
    assert (opts.max_nodes, opts.node_rank, opts.nproc) == (2, 1, 2)
    assert (opts.master_addr, opts.master_port) == ("localhost", 19242)
    given = parse_options(["--nnodes", "1", "--nproc-per-node", "2", str(script)])  # the command line wins
    assert given.max_nodes == 1
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # --ntasks-per-node=2: two launchers per node
    with pytest.raises(LaunchError, match="srun started 4 tasks on 2 nodes"):
        parse_options(["--nproc-per-node", "2", str(script)])

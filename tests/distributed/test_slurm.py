"""SLURM for real: sbatch, srun, scancel and scontrol requeue on a slurmctld and a slurmd.

The cluster (tests/slurm_cluster.py: Debian's slurm-wlm 22.05, munged, one node, this machine)
is started once for the session by the `slurm` fixture and stopped at its end; without the
packages (`make slurm-deps` installs them) those tests are skipped, saying so. The unit tests
at the top parse the host-list forms SLURM writes and the variables of a task, a batch script
and an salloc shell (SLURM gives those in the jobs below as well)."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.slurm_cluster import SlurmCluster, why_unavailable
from tests.slurm_job import N_TRAIN, OPTIMIZERS, make_data, make_model
from unison.distributed.env import DistribEnv, threads_per_worker
from unison.distributed.slurm import expand_hostlist, is_srun_task, job_port

ROOT = Path(__file__).resolve().parent.parent.parent
JOB = str(ROOT / "tests" / "slurm_job.py")
PY = sys.executable
UNISON = str(Path(sys.executable).parent / "unison")
WAIT_S = 240  # bound on any one job (they take 5-30 s on a loaded 2-core machine)


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


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM cluster for the whole session (munged, slurmctld, one slurmd), stopped after."""
    why = why_unavailable()
    if why:
        pytest.skip(why)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def plain_weights(opt: str, epochs: int, bs: int = 16) -> list[float]:
    """One process, batch `bs`, in order: the reference every SLURM run must end on."""
    x, y = make_data()
    model = make_model()
    cls, lr = OPTIMIZERS[opt]
    optimizer = cls(model.parameters(), lr=lr)
    for _ in range(epochs):
        for k in range(N_TRAIN // bs):
            loss = nn.functional.mse_loss(model(x[k * bs : (k + 1) * bs]), y[k * bs : (k + 1) * bs])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def results(folder: Path, pattern: str = "*.json") -> list[dict]:
    """What the job's ranks wrote (tests/slurm_job.py --results), by file name: opt, attempt, rank."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob(pattern))]


def stopped(out: Path) -> list[dict]:
    """The `STOPPED {"rank": r, "time": t}` lines the job's preempted ranks printed."""
    lines = out.read_text().splitlines()
    return [json.loads(m.group(1)) for line in lines if (m := re.search(r"STOPPED (\{.*?\})", line))]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


def job_env(**extra: str) -> dict[str, str]:
    """What the submitting shell exports (sbatch passes it on): this Python's bin first on PATH, as
    an activated virtualenv would be, and a bounded wait for a lost peer."""
    return {"PATH": f"{Path(PY).parent}:{os.environ['PATH']}", "UNISON_TIMEOUT": "60", **extra}


def ended(slurm: SlurmCluster, job: str, out: Path) -> dict[str, str]:
    info = slurm.wait_done(job, WAIT_S)
    info["output"] = out.read_text() if out.exists() else "(no output file)"
    return info


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_sbatch_ntasks_2_srun_python_trains_as_one_process_with_a_share_of_the_cores(slurm, tmp_path):
    """`sbatch --ntasks=2` + `srun python train.py`, no launcher: the two tasks form the group from
    SLURM's variables and end on the weights of one process at the same global batch (AdamW here,
    SGD in the tests below). Each task runs on its share of the cores, as under `unison launch`
    (each ran as many threads as the machine has cores: 2 tasks x 2 threads on 2 cores)."""
    out = tmp_path / "job.out"
    cmd = f"srun {PY} {JOB} --results {tmp_path} --bs 8 --opt adamw"
    job = slurm.sbatch(["--nodes=1", "--ntasks=2", f"--output={out}", "--wrap", cmd], env=job_env())
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"][-3000:]
    got = results(tmp_path)
    assert sorted((r["rank"], r["world"]) for r in got) == [(0, 2), (1, 2)]
    assert [r["threads"] for r in got] == [threads_per_worker(2)] * 2
    expected = plain_weights("adamw", epochs=2)
    print(f"srun, AdamW: {max(max_diff(r['weights'], expected) for r in got):.1e} from one process")
    assert all(max_diff(r["weights"], expected) < 1e-6 for r in got)


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_one_unison_launch_per_node_under_srun(slurm, tmp_path):
    """`srun --ntasks-per-node=1 unison launch --nproc-per-node 2 train.py`: the launcher takes the
    machines, its node's rank and node 0's address and port from SLURM, and the job ends on one
    process's weights. A step with more launchers than nodes is refused naming both numbers."""
    out = tmp_path / "job.out"
    cmd = f"srun --ntasks-per-node=1 {UNISON} launch --nproc-per-node 2 {JOB} --results {tmp_path} --bs 8"
    job = slurm.sbatch(
        ["--nodes=1", "--ntasks=1", "--cpus-per-task=2", f"--output={out}", "--wrap", cmd], env=job_env()
    )
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"][-3000:]
    got = results(tmp_path)
    threads = threads_per_worker(2)
    assert sorted((r["rank"], r["world"], r["threads"]) for r in got) == [(0, 2, threads), (1, 2, threads)]
    expected = plain_weights("sgd", epochs=2)
    print(
        f"unison launch under srun: {max(max_diff(r['weights'], expected) for r in got):.1e} from one process"
    )
    assert all(max_diff(r["weights"], expected) < 1e-6 for r in got)
    said = f"unison launch: 2 process(es) on this machine; {threads} thread(s) each"
    assert said in info["output"], info["output"][-3000:]

    refused_out = tmp_path / "refused.out"
    cmd = f"srun {UNISON} launch --nproc-per-node 2 {JOB} --results {tmp_path}"
    job = slurm.sbatch(["--nodes=1", "--ntasks=2", f"--output={refused_out}", "--wrap", cmd], env=job_env())
    info = ended(slurm, job, refused_out)
    assert info["JobState"] == "FAILED", info["output"][-3000:]
    assert "srun started 2 tasks on 1 nodes, but unison launch runs one per node" in info["output"]


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_two_nodes_a_task_per_process_and_a_launcher_per_node(slurm, tmp_path):
    """Two nodes (two slurmd, each with its own host name): `srun --ntasks-per-node=1 python
    train.py` finds rank 0 on the first node of `unison-n[1-2]`; `srun --ntasks-per-node=1 unison
    launch --nproc-per-node 2` makes 4 ranks, node 1's launcher taking its rank and node 0's
    address from SLURM. Both end on one process's weights at the same global batch."""
    if len(slurm.nodes) < 2:
        pytest.skip("one node only: this machine refused the namespaces a second slurmd needs")
    out = tmp_path / "job.out"
    tasks = f"srun {PY} {JOB} --results {tmp_path / 'tasks'} --bs 8"
    launchers = f"srun {UNISON} launch --nproc-per-node 2 {JOB} --results {tmp_path / 'launch'} --bs 4"
    script = f"mkdir {tmp_path / 'tasks'} {tmp_path / 'launch'} && {tasks} && {launchers}"
    args = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", f"--output={out}", "--wrap", script]
    job = slurm.sbatch(args, env=job_env())
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "unison-n[1-2]"), (
        info
    )
    expected = plain_weights("sgd", epochs=2)
    for way, world in (("tasks", 2), ("launch", 4)):
        got = results(tmp_path / way)
        assert sorted((r["rank"], r["world"]) for r in got) == [(r, world) for r in range(world)]
        print(f"two nodes, {way}: {max(max_diff(r['weights'], expected) for r in got):.1e} from one process")
        assert all(max_diff(r["weights"], expected) < 1e-6 for r in got)
    assert re.search(r"unison launch: 2 process\(es\) on node 1 of 2, master unison-n1:\d+", info["output"])


def wait_for(path: Path, job: str, slurm: SlurmCluster) -> None:
    """Poll until `path` exists (the job's cue), failing at once if the job ended first."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state} before {path.name}"
        assert time.monotonic() < deadline, f"no {path} after {WAIT_S} s"
        time.sleep(0.05)


def steps_trained(folder: Path, rank: int) -> list[tuple[int, int]]:
    """(attempt, global step) of every optimizer step rank `rank` finished, in order."""
    lines = (folder / f"steps-{rank}").read_text().split("\n")
    return [(int(a), int(s)) for a, s in (line.split() for line in lines if line)]


# 12 steps; one checkpoint: the stop's. --hold: the ranks wait at the cue for the signal
PREEMPTIBLE = f"srun {PY} {JOB} --bs 8 --epochs 3 --every 100 --step-s 0.2 --hold"


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_scancel_signal_usr1_stops_every_rank_checkpointed_and_the_job_resumes(slurm, tmp_path):
    """`scancel --signal=USR1` (what `#SBATCH --signal=USR1@90` sends before the time limit) reaches
    every task of the step: each rank stops at one step with the checkpoint written, the tasks exit
    75 and so does the job. Submitted again, it resumes from the checkpoint, trains no step twice and
    ends on the weights of one uninterrupted process."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    ckpt.mkdir()
    cmd = f"{PREEMPTIBLE} --results {tmp_path} --dir {ckpt} --ready 3"
    job = slurm.sbatch(["--nodes=1", "--ntasks=2", f"--output={out}", "--wrap", cmd], env=job_env())
    wait_for(ckpt / "ready", job, slurm)
    sent = time.time()
    slurm.run(["scancel", "--signal=USR1", job])
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "75:0"), info["output"][-3000:]
    stops = stopped(out)
    assert sorted(s["rank"] for s in stops) == [0, 1], info["output"][-3000:]
    lag = max(s["time"] for s in stops) - sent
    print(f"every rank stopped {lag:.2f} s after scancel --signal=USR1")
    assert lag < 60
    assert "unison: preempted by SIGUSR1: every rank stopped" in info["output"]
    exits = re.findall(r"srun: error: \S+: tasks? ([-\d]+): Exited with exit code 75", info["output"])
    assert exits in (["0-1"], ["0", "1"], ["1", "0"]), info["output"][-3000:]  # srun's own account
    assert (ckpt / "models" / "checkpoint.pth").exists()
    done = steps_trained(ckpt, 0)
    assert 4 <= len(done) < 12, done  # stopped after the cue, before the end

    out2 = tmp_path / "again.out"
    job = slurm.sbatch(
        [
            "--nodes=1",
            "--ntasks=2",
            f"--output={out2}",
            "--wrap",
            f"{PREEMPTIBLE} --results {tmp_path} --dir {ckpt}",
        ],
        env=job_env(),
    )
    info = ended(slurm, job, out2)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"][-3000:]
    for rank in (0, 1):
        assert [s for _, s in steps_trained(ckpt, rank)] == list(range(12))  # each step once
    expected = plain_weights("sgd", epochs=3)
    diff = max(max_diff(r["weights"], expected) for r in results(tmp_path))
    print(f"preempted and resumed: {diff:.1e} from one process")
    assert all(max_diff(r["weights"], expected) < 1e-6 for r in results(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_the_real_scontrol_requeue_restarts_the_job_where_it_stopped(slurm, tmp_path):
    """`#SBATCH --requeue` with UNISON_REQUEUE=1: on `scancel --signal=USR1` rank 0 runs the real
    `scontrol requeue` once the checkpoint is written; SLURM then kills the job's tasks itself (they
    end by its SIGTERM a moment after the checkpoint, not with 75), holds the job `cred_expire + 1`
    s (6 s here: tests/slurm_cluster.py) and starts it again with the same id; the job resumes, no
    step is trained twice, and it ends on one uninterrupted process's weights."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    ckpt.mkdir()
    cmd = f"{PREEMPTIBLE} --results {tmp_path} --dir {ckpt} --ready 5"
    args = ["--nodes=1", "--ntasks=2", "--requeue", "--open-mode=append", f"--output={out}", "--wrap", cmd]
    job = slurm.sbatch(args, env=job_env(UNISON_REQUEUE="1"))
    wait_for(ckpt / "ready", job, slurm)
    slurm.run(["scancel", "--signal=USR1", job])
    requeued = time.time()
    held = slurm.wait_state(job, {"PENDING"}, WAIT_S)
    info = slurm.wait_state(job, {"RUNNING"}, WAIT_S)
    again = time.time() - requeued
    print(f"held ({held['Reason']}) until {held['EligibleTime']}; ran again {again:.1f} s after the signal")
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info["output"]
    # scontrol answers, or SLURM's requeue stops it (and the job) before it does: both say requeued
    said = [line for line in info["output"].splitlines() if f"scontrol requeue {job}" in line]
    assert said and "failed" not in said[0], info["output"]
    assert f"job {job} requeued (scontrol requeue {job})" in said[0] or f"job {job} requeue asked" in said[0]
    assert f"JOB {job} ON {slurm.node} CANCELLED AT" in info["output"]  # SLURM ends the first attempt
    # ...by SIGTERM to every task ("Terminated"), or after a task left with 75 ("Exited with exit code 75")
    ends = re.findall(
        r"srun: error: \S+: tasks? [-\d]+: (Terminated|Exited with exit code 75)", info["output"]
    )
    assert ends, info["output"]
    print(f"the first attempt's tasks: {ends}")
    for rank in (0, 1):
        steps = steps_trained(ckpt, rank)
        assert [s for _, s in steps] == list(range(12)), steps  # each step once, over the two attempts
        assert {a for a, _ in steps} == {0, 1}
    got = results(tmp_path)
    assert [(r["attempt"], r["rank"]) for r in got] == [("1", 0), ("1", 1)]
    expected = plain_weights("sgd", epochs=3)
    print(f"requeued and resumed: {max(max_diff(r['weights'], expected) for r in got):.1e} from one process")
    assert all(max_diff(r["weights"], expected) < 1e-6 for r in got)


def submit_dir(tmp_path: Path) -> Path:
    """A folder to submit from, as a user's checkout: `examples/` as in the repository."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT_S)
def test_the_shipped_batch_script_runs_as_is_on_one_node(slurm, tmp_path):
    """`sbatch examples/slurm/train.sbatch` as shipped (it asked for 2 nodes: refused on a one-node
    cluster), one epoch (its arguments go to the training script): it trains examples/train_digits.py
    on 2 tasks and writes the model and the loss plot under runs/slurm-<job>."""
    here = submit_dir(tmp_path)
    job = slurm.sbatch(["examples/slurm/train.sbatch", "--epochs", "1"], cwd=here, env=job_env())
    out = here / f"unison-digits-{job}.out"
    info = ended(slurm, job, out)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"][-3000:]
    assert re.search(r"valid_accuracy 0\.\d+", info["output"]), info["output"][-3000:]
    run = here / "runs" / f"slurm-{job}"
    assert (run / "models" / "digits.pth").exists() and (run / "loss.png").exists()


@pytest.mark.slow
def test_the_shipped_batch_script_names_what_is_missing_before_training(slurm, tmp_path):
    """Without the examples' extras (`pip install unison` alone: no matplotlib for the loss plot),
    the job fails at once naming them, not with a ModuleNotFoundError after training."""
    here = submit_dir(tmp_path)
    hidden = tmp_path / "hide"  # first on the path: `import matplotlib` fails as if not installed
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n"
    )
    env = job_env(PYTHONPATH=f"{hidden}:{os.environ.get('PYTHONPATH', '')}")
    job = slurm.sbatch(["examples/slurm/train.sbatch", "--epochs", "1"], cwd=here, env=env)
    info = ended(slurm, job, here / f"unison-digits-{job}.out")
    assert info["JobState"] == "FAILED", info["output"][-3000:]
    assert "train.sbatch: matplotlib missing" in info["output"], info["output"][-3000:]
    assert "pip install 'unison[examples]'" in info["output"]
    assert not (here / "runs" / f"slurm-{job}" / "models").exists()  # nothing trained


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT_S)
@pytest.mark.parametrize("world", [2, 4])
def test_a_resumed_run_against_the_same_job_uninterrupted(slurm, tmp_path, world):
    """By hand (`UNISON_SLURM_RESUME=1 python -m pytest -s tests/distributed/test_slurm.py -k
    uninterrupted`): `world` tasks stopped by `scancel --signal=USR1` and resubmitted, against the
    same job uninterrupted. Bit-equal on 2 ranks; on 4, the first step after the resume sums the
    gradients in another order (DDP's first bucket layout, docs/faults.md states the bound)."""
    if not os.environ.get("UNISON_SLURM_RESUME"):
        pytest.skip("by hand: set UNISON_SLURM_RESUME=1 (two more jobs of 30-60 s each)")
    bs, opt = 16 // world, os.environ.get("UNISON_SLURM_OPT", "sgd")
    run = f"srun {PY} {JOB} --bs {bs} --epochs 3 --opt {opt}"
    ckpt, ref, res = tmp_path / "ckpt", tmp_path / "ref", tmp_path / "res"
    for folder in (ckpt, ref, res):
        folder.mkdir()
    one = ["--nodes=1", f"--ntasks={world}"]
    uninterrupted = slurm.sbatch(
        [*one, "-o", str(tmp_path / "ref.out"), "--wrap", f"{run} --results {ref}"], env=job_env()
    )
    stop_at = f"{run} --results {res} --dir {ckpt} --every 100 --step-s 0.3 --ready 5 --hold"
    job = slurm.sbatch([*one, "-o", str(tmp_path / "p.out"), "--wrap", stop_at], env=job_env())
    wait_for(ckpt / "ready", job, slurm)
    slurm.run(["scancel", "--signal=USR1", job])
    assert slurm.wait_done(job, WAIT_S)["ExitCode"] == "75:0"
    job = slurm.sbatch(
        [*one, "-o", str(tmp_path / "r.out"), "--wrap", f"{run} --results {res} --dir {ckpt}"], env=job_env()
    )
    for done in (job, uninterrupted):
        assert slurm.wait_done(done, WAIT_S)["ExitCode"] == "0:0"
    diff = max(max_diff(a["weights"], b["weights"]) for a, b in zip(results(ref), results(res), strict=True))
    print(f"{world} ranks, {opt}: resumed {diff:.2e} from the same job uninterrupted")
    assert diff == 0.0 if world == 2 else diff < 1e-6

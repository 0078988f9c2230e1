"""Kubernetes (issue 22, item 3): `unison launch train.py`, with no option, in the environment each
operator gives a container, on two machines (network namespaces joined by a veth pair).

No Kubernetes runs here. Each test gives two real launchers exactly the variables the operator sets
in its pods (read from its source: Kubeflow's training-operator `pkg/controller.v1/pytorch/envvar.go`,
`master.go`, `elastic.go`; Trainer v2's torch plugin; TorchX through `examples/kubernetes/
unison_torchx.py`'s own command line), and checks that training ends where one machine running
`--nproc 2` does, which the launch tests hold equal to one process at twice the batch. A pod
replaced mid-run is played by killing one namespace's launcher with its workers (SIGKILL, as a
node lost) and starting a new one there with the same variables.
"""

# ruff: noqa: F811  (the fixtures below are imported from the other launch tests and used as arguments)
from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.launch.test_cluster_faults import Job, leftovers, uninterrupted, weights  # noqa: F401  (fixtures)
from tests.launch.test_launch import LAUNCH, PY, ROOT, finish, start, tagged
from tests.launch.test_multinode import (  # noqa: F401  (fixtures)
    TRAIN,
    Machines,
    assert_same_training,
    machines,
    netns_port,
    result,
    single_machine,
)
from unison.launch.kubernetes import pytorchjob_layout
from unison.launch.launcher import parse_options

_spec = importlib.util.spec_from_file_location("unison_torchx", ROOT / "examples/kubernetes/unison_torchx.py")
unison_torchx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unison_torchx)

NODE_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(scope="module")
def one_process() -> dict:
    """W=1: the same script as one plain process at the global batch (2 x 8)."""
    rc, out, err, _ = finish(start([PY, TRAIN, "--bs", "16"], unset=NODE_VARS))
    assert rc == 0, err[-3000:]
    return result(out)


def unset(env: dict[str, str]) -> tuple[str, ...]:
    """The node variables of this test's own environment that the pod's variables do not set."""
    return tuple(name for name in NODE_VARS if name not in env)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in NODE_VARS:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def pod_v1(i: int, addr: str, port: int, pods: int = 2) -> dict[str, str]:
    """A PyTorchJob (v1) pod without nprocPerNode: Master is pod 0, Worker j is pod j+1."""
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(pods), "RANK": str(i)}


def pod_v1_nproc(i: int, addr: str, port: int, nproc: int, pods: int = 2) -> dict[str, str]:
    """A newer operator's pod with spec.nprocPerNode: WORLD_SIZE counts processes, PET_* the pods."""
    env = pod_v1(i, addr, port, pods) | {"WORLD_SIZE": str(pods * nproc)}
    return env | {"PET_MASTER_ADDR": addr, "PET_MASTER_PORT": str(port), "PET_NNODES": str(pods),
                  "PET_NODE_RANK": str(i), "PET_NPROC_PER_NODE": str(nproc)}  # fmt: skip


def pod_v2(i: int, addr: str, port: int) -> dict[str, str]:
    """A Trainer v2 TrainJob node (torch-distributed runtime): torchrun's variables only."""
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": addr, "PET_MASTER_PORT": str(port)}  # fmt: skip


def pod_elastic(endpoint: str, nnodes: str = "1:2", restarts: int = 0) -> dict[str, str]:
    """A PyTorchJob with an elasticPolicy (Worker replicas only, no MASTER_ADDR/RANK)."""
    return {"PET_RDZV_ENDPOINT": endpoint, "PET_RDZV_BACKEND": "c10d", "PET_NNODES": nnodes,
            "PET_MAX_RESTARTS": str(restarts), "PET_NPROC_PER_NODE": "1", "PET_RDZV_ID": "job-7"}  # fmt: skip


# ---- what unison launch reads, checked in this process -------------------------------------------
def test_a_v1_pods_world_size_and_rank_count_pods(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as process ranks, two pods would each train alone (torch's agent gives its worker rank 0
    of 1): the pod variables make pod 1 node 1 of 2, its master the Master's service."""
    for name, value in pod_v1(1, "localhost", 23456).items():
        monkeypatch.setenv(name, value)
    opts = parse_options([script])
    assert (opts.mode, opts.max_nodes, opts.node_rank, opts.nproc) == ("static", 2, 1, 1)
    assert (opts.master_addr, opts.master_port) == ("localhost", 23456)
    given = parse_options(["--nnodes", "1", script])  # the command line wins, as over SLURM's
    assert (given.mode, given.max_nodes) == ("standalone", 1)


def test_petvariables_win_where_world_size_counts_processes(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in pod_v1_nproc(1, "localhost", 23456, nproc=2).items():
        monkeypatch.setenv(name, value)  # WORLD_SIZE=4: processes, not 4 pods
    opts = parse_options([script])
    assert (opts.max_nodes, opts.node_rank, opts.nproc, opts.master_port) == (2, 1, 2, 23456)


def test_trainer_v2_and_elastic_variables(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        for name, value in pod_v2(1, "127.0.0.1", 29400).items():
            m.setenv(name, value)
        opts = parse_options([script])
        assert (opts.mode, opts.max_nodes, opts.node_rank, opts.master_addr) == ("static", 2, 1, "127.0.0.1")
    for name, value in pod_elastic("127.0.0.1:29400", "1:3", restarts=3).items():
        monkeypatch.setenv(name, value)
    opts = parse_options([script])
    assert (opts.mode, opts.min_nodes, opts.max_nodes, opts.max_restarts) == ("elastic", 1, 3, 3)
    assert (opts.rdzv_endpoint, opts.rdzv_id) == ("127.0.0.1:29400", "job-7")


def test_pod_variables_that_say_nothing_or_contradict() -> None:
    assert pytorchjob_layout(pod_v1(0, "m", 1, pods=1)) is None  # one pod: a standalone launch
    assert pytorchjob_layout({**pod_v1(0, "m", 1), "LOCAL_RANK": "0"}) is None  # a launched worker
    assert pytorchjob_layout({"MASTER_ADDR": "m", "MASTER_PORT": "1"}) is None  # a script's own group
    with pytest.raises(ValueError, match=r"RANK=2 is outside WORLD_SIZE=2"):
        pytorchjob_layout(pod_v1(2, "m", 1))
    with pytest.raises(ValueError, match="must be numbers"):
        pytorchjob_layout({**pod_v1(0, "m", 1), "WORLD_SIZE": "two"})


def test_the_torchx_components_command_line() -> None:
    line = unison_torchx.launch_command("train.py", ["--bs", "32"], j="1:2x1", rdzv_id="app", max_restarts=2)
    assert line == (
        "PET_NNODES=1:2 PET_NPROC_PER_NODE=1 PET_RDZV_BACKEND=c10d PET_RDZV_ID=app PET_MAX_RESTARTS=2 "
        "PET_RDZV_ENDPOINT=${TORCHX_RANK0_HOST:=localhost}:29500 exec unison launch train.py --bs 32"
    )
    with pytest.raises(ValueError, match="NNODESxNPROC"):
        unison_torchx.parse_j("2")


# ---- two machines ----------------------------------------------------------------------------------
def nodes_env(kind: str, machines: Machines, port: int) -> list[dict[str, str]]:
    addr = machines.addrs[0]
    if kind == "pytorchjob-v1":
        return [pod_v1(i, addr, port) for i in (0, 1)]
    if kind == "pytorchjob-v1-nproc":
        return [pod_v1_nproc(i, addr, port, nproc=2) for i in (0, 1)]
    if kind == "trainjob-v2":
        return [pod_v2(i, addr, port) for i in (0, 1)]
    return [pod_elastic(f"{addr}:{port}") for _ in (0, 1)]  # elastic 1:2, both pods up


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["pytorchjob-v1", "pytorchjob-v1-nproc", "trainjob-v2", "elastic-1:2"])
def test_each_operators_pods_train_as_one_machine(
    kind: str, machines: Machines, single_machine: dict, one_process: dict
) -> None:
    """`unison launch train.py` and nothing else in each pod; v1-nproc runs 2 processes a pod at half
    the batch (4 x 4 = 2 x 8), so a WORLD_SIZE read as pods would be 4 machines and never start."""
    port = netns_port()
    args = ["--bs", "4"] if kind == "pytorchjob-v1-nproc" else []
    envs = nodes_env(kind, machines, port)
    nodes = [
        start(machines.cmd(i, [*LAUNCH, TRAIN, *args]), env=envs[i], unset=unset(envs[i])) for i in (0, 1)
    ]
    (rc0, out0, err0, _), (rc1, out1, err1, _) = (finish(p, timeout=150) for p in nodes)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert_same_training(result(out0 + out1), single_machine)
    assert_same_training(result(out0 + out1), one_process)  # W > 1 equals W = 1
    info = tagged(err0 + err1, "RANKINFO")
    world = 4 if kind == "pytorchjob-v1-nproc" else 2
    assert sorted(int(i["RANK"]) for i in info) == list(range(world))
    assert {i["WORLD_SIZE"] for i in info} == {str(world)}
    assert {i["GLOO_SOCKET_IFNAME"] for i in info} == set(machines.links)  # each on its own veth end


@pytest.mark.launch
def test_the_torchx_components_command_on_two_machines(
    machines: Machines, single_machine: dict, one_process: dict
) -> None:
    """The component's own shell line, run by bash in each namespace with the rank-0 host variable set
    as a scheduler sets it (TorchX itself is not installed here: its urllib3 pin clashes with ray's)."""
    port = netns_port()
    launcher = " ".join(LAUNCH)
    line = unison_torchx.launch_command(TRAIN, j="2x1", rdzv_id="app-1", rdzv_port=port, launcher=launcher)
    env = {"TORCHX_RANK0_HOST": machines.addrs[0]}
    nodes = [start(machines.cmd(i, ["bash", "-c", line]), env=env, unset=unset(env)) for i in (0, 1)]
    (rc0, out0, err0, _), (rc1, out1, err1, _) = (finish(p, timeout=150) for p in nodes)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert_same_training(result(out0 + out1), single_machine)
    assert_same_training(result(out0 + out1), one_process)
    assert f"elastic job 'app-1' at {machines.addrs[0]}:{port}" in err0


@pytest.mark.launch
def test_an_elastic_pod_replaced_mid_run_ends_on_the_uninterrupted_weights(
    machines: Machines,
    uninterrupted: str,
    tmp_path: Path,
) -> None:
    """Elastic 1:2 with restarts: after step 5 the pod that does not host the rendezvous (as Kubernetes
    loses a node) dies whole, launcher and workers; a new pod starts with the same variables on the
    same shared folder. The other pod's workers fail on the lost peer, its agent restarts them, both
    pods meet in the next round and resume from the checkpoint to the uninterrupted weights."""
    env = pod_elastic(f"{machines.addrs[0]}:{netns_port()}", restarts=3)
    script = ["--cue-rank", "0", "--at", "5", "--cue", "hold"]  # every rank waits at step 5 for D/go

    def pod(i: int) -> Job:
        return Job(tmp_path, script_args=script, nproc=None, prefix=machines.cmd(i, []), env=env)

    pods = [pod(0), pod(1)]
    pods[0].cue()  # step 5 is done and checkpointed; every rank waits there, outside any collective
    lost = psutil.Process(pods[1].proc.pid)
    for proc in [*lost.children(recursive=True), lost]:
        proc.send_signal(signal.SIGKILL)
    lost_at = time.monotonic()
    pods[1].finish(limit=30)
    (tmp_path / "go").touch()  # the survivor's next collective finds its peer gone
    assert pods[1].rc == -signal.SIGKILL
    replacement = pod(1)
    replacement.finish(limit=200)
    pods[0].finish(limit=60)
    print(f"seconds from the lost pod to the job's end: {time.monotonic() - lost_at:.1f}")
    assert replacement.rc == 0, replacement.err[-3000:]
    assert pods[0].rc == 0, pods[0].err[-3000:]
    assert "restarting the workers" in pods[0].err, pods[0].err[-3000:]
    assert weights(pods[0].out + replacement.out) == {uninterrupted}
    assert len(weights(pods[0].out)) == len(weights(replacement.out)) == 1  # both ranks printed it
    steps = re.findall(r"STEPS rank(\d) (\d+)", pods[0].out + replacement.out)
    # Resumed from the newest checkpoint (step 4's or 5's: the last is written as step 5's batch ends,
    # while the ranks wait), not started again (8 steps).
    assert sorted(rank for rank, _ in steps) == ["0", "1"] and {n for _, n in steps} in ({"3"}, {"4"}), steps
    assert leftovers(str(tmp_path)) == []


@pytest.mark.launch
def test_an_elastic_job_that_loses_a_pod_for_good_goes_on_alone_at_a_smaller_global_batch(
    machines: Machines, uninterrupted: str, tmp_path: Path
) -> None:
    """Elastic 1:2 with restarts, a pod lost after step 5 and never replaced: after the rendezvous'
    last call the other pod goes on alone (W=1) from the checkpoint, at global batch 8 instead of 16,
    so it ends (on one rank) but not on the uninterrupted weights, and says so in one warning line at
    the resume. The rendezvous' last call is 5 s here (torch's default 30 s only makes the test wait)."""
    env = pod_elastic(f"{machines.addrs[0]}:{netns_port()}", restarts=3)
    env["PET_RDZV_CONF"] = "last_call_timeout=5"
    script = ["--cue-rank", "0", "--at", "5", "--cue", "hold"]
    pods = [
        Job(tmp_path, script_args=script, nproc=None, prefix=machines.cmd(i, []), env=env) for i in (0, 1)
    ]
    pods[0].cue()
    lost = psutil.Process(pods[1].proc.pid)
    for proc in [*lost.children(recursive=True), lost]:
        proc.send_signal(signal.SIGKILL)
    pods[1].finish(limit=30)
    (tmp_path / "go").touch()
    pods[0].finish(limit=150)
    assert pods[0].rc == 0, pods[0].err[-3000:]
    assert "restarting the workers" in pods[0].err, pods[0].err[-3000:]
    assert re.findall(r"WEIGHTS rank(\d)", pods[0].out) == ["0"]  # one rank: W=1
    assert weights(pods[0].out) != {uninterrupted}  # another global batch: another run
    assert "GlobalBatchChangedWarning" in pods[0].err and "the interrupted run had 16" in pods[0].err
    steps = re.findall(r"STEPS rank0 (\d+)", pods[0].out)
    assert steps in (["6"], ["8"]), steps  # 48 or 64 samples left, 8 a step


@pytest.mark.launch
def test_a_v1_pod_lost_then_both_restarted_on_failure_end_on_the_uninterrupted_weights(
    machines: Machines, uninterrupted: str, tmp_path: Path
) -> None:
    """A PyTorchJob (v1, static) with `restartPolicy: OnFailure`: after step 5 the Worker's pod dies
    whole; the Master's workers fail on the lost peer and its launcher ends non-zero, so Kubernetes
    restarts both containers, in the same namespaces with the same variables (the Master's port
    again). The restarted job resumes from the checkpoint to the uninterrupted weights."""
    env = [pod_v1(i, machines.addrs[0], netns_port()) for i in (0, 1)]
    env[1]["MASTER_PORT"] = env[0]["MASTER_PORT"]
    script = ["--cue-rank", "0", "--at", "5", "--cue", "hold"]

    def pod(i: int) -> Job:
        return Job(tmp_path, script_args=script, nproc=None, prefix=machines.cmd(i, []), env=env[i])

    first = [pod(0), pod(1)]
    first[0].cue()
    lost = psutil.Process(first[1].proc.pid)
    for proc in [*lost.children(recursive=True), lost]:
        proc.send_signal(signal.SIGKILL)
    first[1].finish(limit=30)
    (tmp_path / "go").touch()
    first[0].finish(limit=60)
    assert first[0].rc not in (0, None), first[0].err[-3000:]
    assert "unison launch: rank" in first[0].err, first[0].err[-3000:]  # the summary names a rank
    again = [pod(0), pod(1)]
    for job in again:
        job.finish(limit=150)
    for job in again:
        assert job.rc == 0, job.err[-3000:]
    assert weights(again[0].out + again[1].out) == {uninterrupted}
    steps = re.findall(r"STEPS rank(\d) (\d+)", again[0].out + again[1].out)
    assert sorted(rank for rank, _ in steps) == ["0", "1"] and {n for _, n in steps} in ({"3"}, {"4"}), steps
    assert leftovers(str(tmp_path)) == []


def test_the_manifests_run_unison_launch_with_no_option() -> None:
    """The shipped manifests' containers run `unison launch SCRIPT`, nothing between."""
    for name in ("pytorchjob.yaml", "pytorchjob-elastic.yaml", "trainjob.yaml"):
        text = (ROOT / "examples" / "kubernetes" / name).read_text()
        commands = [line for line in text.splitlines() if line.strip().startswith("command:")]
        assert commands, name
        for line in commands:
            assert '["unison", "launch", "examples/train_digits.py"' in line, (name, line)
    assert (
        subprocess.run(["bash", "-n", "-c", unison_torchx.launch_command("t.py")], timeout=10).returncode == 0
    )

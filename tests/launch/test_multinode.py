"""Several machines: `unison launch --nnodes 2` on loopback, and on two real network namespaces.

All of them must end training exactly as one machine running `--nproc 2` does (the reference
fixture), and so must a 2-process run whose rank is killed mid-epoch and restarted.

The namespaces test builds two "machines" joined by a veth pair (10.213.7.1 and 10.213.7.2,
each with its own loopback), runs one launch command in each, and checks that training ends
exactly as a single-machine `--nproc 2` run of the same script, with gloo bound to the veth
interface. It needs root and iproute2 (`ip netns`), and skips with the reason otherwise.
Traffic only ever goes to loopback or to the namespaces' own addresses.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch.shared_runs import once_per_session
from tests.launch.test_launch import LAUNCH, PY, ROOT, SCRIPTS, digests, finish, free_port, start, tagged

pytestmark = pytest.mark.launch  # real processes: launches, spawns, kills

TRAIN = str(SCRIPTS / "train_tiny.py")
SUBNET = "10.213.7"

# Ports for servers inside the namespaces (a rendezvous store on machine A): below their ephemeral
# range (32768-60999), so no outgoing connection takes one, and never the same twice in this
# process, so two jobs of one test, or a test and an earlier one on the same namespaces, never meet
# on one port. (Random picks in 29000-29999 could meet; a quiet full run once failed where a node
# of one job could not join its rendezvous, its connection broken, which a shared port explains.)
_netns_ports = itertools.count(29000 + random.randrange(0, 1000, 10))


def netns_port() -> int:
    """A port no earlier test of this process used: for a server inside the network namespaces."""
    return next(_netns_ports)


def result(out: str) -> dict:
    (found,) = tagged(out, "RESULT")
    return found


def assert_same_training(got: dict, expected: dict) -> None:
    assert got["weights"] == pytest.approx(expected["weights"], rel=1e-6, abs=1e-6)
    assert got["valid"] == pytest.approx(expected["valid"], rel=1e-6, abs=1e-6)


def _run_single_machine(folder: Path) -> dict:
    rc, out, err, _ = finish(start([*LAUNCH, "--nproc", "2", TRAIN]))
    assert rc == 0, err
    return result(out)


@pytest.fixture(scope="module")
def single_machine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: the same script on one machine, `--nproc 2` (run once per session: test_kubernetes
    reads it too)."""
    return once_per_session("single_machine", tmp_path_factory, _run_single_machine)


def test_killed_rank_restarts_and_resumes_to_the_same_weights(single_machine: dict, tmp_path: Path) -> None:
    """--max-restarts: rank 1 is SIGKILLed mid-epoch; torch's agent restarts both ranks, `fit(resume=True)`
    continues from the last checkpoint, and training ends where the uninterrupted run did."""
    cmd = [*LAUNCH, "--nproc", "2", "--max-restarts", "1", TRAIN, "--ckpt", str(tmp_path), "--crash", "5"]
    rc, out, err, _ = finish(start(cmd))
    assert rc == 0, err
    assert "unison launch: restarting the workers (restart 1 of 1)" in err
    assert (tmp_path / "models" / "checkpoint.pth").exists()
    assert_same_training(result(out), single_machine)


def node_cmd(rank: int, addr: str, port: int, script: str = TRAIN) -> list[str]:
    return [*LAUNCH, "--nnodes", "2", "--node-rank", str(rank), "--master-addr", addr,
            "--master-port", str(port), "--timeout", "60", script]  # fmt: skip


def test_two_nodes_on_loopback_match_one_machine(single_machine: dict) -> None:
    """Static (--master-addr/--master-port) and elastic (--rdzv-endpoint) pairs, run together."""
    static_port, elastic_port = free_port(), free_port()
    elastic = [*LAUNCH, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{elastic_port}", "--timeout", "60"]
    procs = {
        "static0": start(node_cmd(0, "127.0.0.1", static_port)),
        "static1": start(node_cmd(1, "127.0.0.1", static_port)),
        "elastic_a": start([*elastic, TRAIN]),
        "elastic_b": start([*elastic, TRAIN]),
    }
    done = {name: finish(p) for name, p in procs.items()}
    for name, (rc, _, err, _) in done.items():
        assert rc == 0, f"{name}:\n{err}"
    assert_same_training(result(done["static0"][1]), single_machine)
    assert not tagged(done["static1"][1], "RESULT")  # the script prints RESULT on rank 0 only
    (elastic_result,) = [r for name in ("elastic_a", "elastic_b") for r in tagged(done[name][1], "RESULT")]
    assert_same_training(elastic_result, single_machine)
    info = tagged(done["static1"][2], "RANKINFO")
    assert [(i["RANK"], i["LOCAL_RANK"], i["WORLD_SIZE"], i["GLOO_SOCKET_IFNAME"]) for i in info] == [
        ("1", "0", "2", "lo")
    ]


# ---- two machines: network namespaces joined by a veth pair ----------------------------------------
@dataclass(frozen=True)
class Machines:
    names: tuple[str, str]  # namespaces
    links: tuple[str, str]  # veth ends, one in each
    addrs: tuple[str, str]

    def cmd(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def machines() -> Iterator[Machines]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (no `ip` command): apt-get install iproute2")
    tag = uuid.uuid4().hex[:6]  # interface names must stay under 16 characters
    m = Machines((f"unsA{tag}", f"unsB{tag}"), (f"unvA{tag}", f"unvB{tag}"), (f"{SUBNET}.1", f"{SUBNET}.2"))
    created: list[str] = []
    try:
        for ns in m.names:
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", m.links[0], "type", "veth", "peer", "name", m.links[1])
        for ns, link, addr in zip(m.names, m.links, m.addrs, strict=True):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"network namespaces are not available here: {str(detail).strip()}")
    try:
        yield m
    finally:  # deleting a namespace removes its veth end, and the pair with it
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_two_machines_match_one_machine(machines: Machines, single_machine: dict) -> None:
    port = netns_port()  # inside namespace A: nothing else listens there
    node0 = start(machines.cmd(0, node_cmd(0, machines.addrs[0], port)))
    node1 = start(machines.cmd(1, node_cmd(1, machines.addrs[0], port)))
    (rc0, out0, err0, _), (rc1, _, err1, _) = finish(node0), finish(node1)
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    assert_same_training(result(out0), single_machine)
    for i, err in enumerate((err0, err1)):  # each node: gloo on its veth end, not loopback
        (info,) = tagged(err, "RANKINFO")
        assert (info["RANK"], info["GLOO_SOCKET_IFNAME"]) == (str(i), machines.links[i]), err
        assert info["MASTER_ADDR"] == machines.addrs[0]
        assert f"gloo via {machines.links[i]}" in err


def test_cpu_multinode_example_by_hand_on_two_machines(machines: Machines) -> None:
    """examples/cpu_multinode.py: a plain process per machine, no launcher, the script makes its group."""
    example = str(ROOT / "examples" / "cpu_multinode.py")
    port = str(netns_port())
    procs = [
        start(
            machines.cmd(
                r,
                [
                    PY,
                    example,
                    "--world-size",
                    "2",
                    "--rank",
                    str(r),
                    "--host",
                    machines.addrs[0],
                    "--port",
                    port,
                    "--timeout",
                    "60",
                ],
            )
        )  # fmt: skip
        for r in (0, 1)
    ]
    (rc0, out0, err0, _), (rc1, out1, err1, _) = (finish(p) for p in procs)
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    d0, d1 = digests(out0), digests(out1)
    assert list(d0) == [0] and list(d1) == [1]
    assert d0[0] == d1[1], "the two machines ended with different weights"


def test_two_machines_kill_and_restart_end_on_the_uninterrupted_weights(
    machines: Machines, single_machine: dict, tmp_path: Path
) -> None:
    """Elastic, --max-restarts 1: node 1's worker is SIGKILLed mid-epoch. Node 1's agent counts a
    restart, node 0's restarts its worker for the re-joining node without counting one, so the two
    workers see different TORCHELASTIC_RESTART_COUNTs: the group must still form at once (it used
    to wait on different store keys until the timeout) and end on the uninterrupted weights."""
    endpoint = f"{machines.addrs[0]}:{netns_port()}"
    elastic = [*LAUNCH, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--max-restarts", "1"]
    elastic += ["--timeout", "60"]
    marker = tmp_path / "killed"
    train = [TRAIN, "--ckpt", str(tmp_path)]
    nodes = [
        start(machines.cmd(0, [*elastic, *train])),
        start(machines.cmd(1, [*elastic, *train, "--crash", "5", "--crash-once", str(marker)])),
    ]
    (rc0, out0, err0, t0), (rc1, out1, err1, t1) = (finish(p, timeout=150) for p in nodes)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert marker.exists(), "node 1's worker was never killed"
    assert "unison launch: restarting the workers (restart 1 of 1)" in err1
    assert_same_training(result(out0 + out1), single_machine)
    assert max(t0, t1) < 60, (t0, t1)  # not one --timeout spent waiting on another attempt's keys

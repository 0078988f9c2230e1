"""Elastic launches across two network namespaces that share one hostname, as cloned machines do.

`ip netns` namespaces keep the host's hostname (and /etc/hosts maps it to 127.0.0.1), so
torch's hostname test alone would let neither node host the c10d store: the launch waited
13 minutes, then failed. The node that owns the endpoint's address must host it.
"""

from __future__ import annotations

import time

import pytest

from tests.launch.test_launch import LAUNCH, finish, start, tagged
from tests.launch.test_multinode import (  # noqa: F401  (fixtures)
    TRAIN,
    Machines,
    machines,
    netns_port,
    result,
)

pytestmark = pytest.mark.launch


def elastic(endpoint: str, timeout: int) -> list[str]:
    return [*LAUNCH, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--timeout", str(timeout), TRAIN]


def test_the_node_owning_the_endpoint_hosts_the_store_whatever_the_hostname(machines: Machines) -> None:  # noqa: F811
    endpoint = f"{machines.addrs[0]}:{netns_port()}"
    nodes = [start(machines.cmd(i, elastic(endpoint, 60))) for i in (0, 1)]
    (rc0, out0, err0, _), (rc1, out1, err1, _) = (finish(p) for p in nodes)
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    # Trained together: rank 0 (on either node) printed the result, both ranks hold the same weights.
    weights = [info["weights"] for info in tagged(err0 + err1, "RANKINFO")]
    assert len(weights) == 2 and weights[0] == weights[1]
    assert result(out0 + out1)["weights"] == weights[0]


def test_a_store_that_no_node_can_host_fails_within_the_timeout_saying_why(machines: Machines) -> None:  # noqa: F811
    nobody = machines.addrs[0].rsplit(".", 1)[0] + ".3"  # on the namespaces' subnet, owned by none
    endpoint = f"{nobody}:{netns_port()}"
    begin = time.monotonic()
    nodes = [start(machines.cmd(i, elastic(endpoint, 5))) for i in (0, 1)]
    done = [finish(p, timeout=120) for p in nodes]
    elapsed = time.monotonic() - begin
    for rc, _, err, _ in done:
        assert rc != 0
        assert f"the node that has the address {nobody} hosts the rendezvous store" in err, err[-2000:]
    assert elapsed < 5 + 30, elapsed

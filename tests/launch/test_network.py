"""The launch's network choices, in this process: addresses, interfaces and routes
(unison.distributed.network), a port in use, and the lighthouse's address (unison.launch.lighthouse).

Each answer is checked against the machine itself, read another way: iproute2's JSON output
(`ip -j`), sockets bound here. No launch, no lighthouse started: the in-process tier.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import socket
import subprocess

import pytest

from unison.distributed.network import (
    UnresolvedHost,
    advertised_host,
    default_route_interface,
    interface_addresses,
    interface_for,
    port_in_use,
    reach_host,
    resolve,
    route_source,
)
from unison.launch.lighthouse import (
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    LighthouseOptionError,
    ReplicaOptions,
    add_replica_options,
    replica_options,
)
from unison.launch.torch_compat import StorePortHold


def ip_json(*args: str) -> list[dict]:
    """iproute2's own JSON answer (`ip -j ...`); the test skips where there is no `ip`."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (no `ip` command)")
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, text=True, timeout=10).stdout)


def test_every_interface_and_address_is_found_as_iproute2_lists_them():
    listed = {
        i["ifname"]: [a["local"] for a in i["addr_info"]] for i in ip_json("addr") if i.get("addr_info")
    }
    assert interface_addresses() == listed
    assert "127.0.0.1" in listed["lo"]


def test_the_interface_chosen_for_a_host_is_the_one_its_route_leaves_by():
    assert interface_for("127.0.0.1") == ("lo", "127.0.0.1")
    assert route_source("127.0.0.1") == "127.0.0.1"
    default = [r for r in ip_json("route", "show", "default") if r.get("gateway")]
    if not default:
        assert default_route_interface() is None
        pytest.skip("no default route here: the loopback case alone")
    gateway, dev = default[0]["gateway"], default[0]["dev"]
    (route,) = ip_json("route", "get", gateway)  # the kernel's own choice of interface and source
    assert route_source(gateway) == route["prefsrc"]
    assert interface_for(gateway) == (route["dev"], route["prefsrc"])
    addresses = [a["local"] for i in ip_json("addr", "show", "dev", dev) for a in i["addr_info"]]
    assert default_route_interface() == (dev, addresses[0])


def test_a_host_resolves_to_an_ipv4_address_first_or_fails_in_one_line():
    assert resolve("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert resolve("localhost") == (socket.AF_INET, "127.0.0.1")  # even where ::1 is listed first
    assert resolve("::1") == (socket.AF_INET6, "::1")
    with pytest.raises(UnresolvedHost) as refused:
        resolve("no-such-host.invalid")
    assert str(refused.value).startswith("cannot resolve host 'no-such-host.invalid': ")
    assert "\n" not in str(refused.value)
    assert route_source("no-such-host.invalid") is None
    assert interface_for("no-such-host.invalid") is None


def test_a_port_is_in_use_while_a_server_listens_on_it_and_not_in_time_wait():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore server does
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_in_use(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    server.close()
    assert not port_in_use(port)  # a store's port left in TIME_WAIT can be served again at once
    with socket.socket() as plain:  # ... while a bind without SO_REUSEADDR still meets it: it is real
        with pytest.raises(OSError) as met:
            plain.bind(("", port))
        assert met.value.errno == errno.EADDRINUSE


# ---- the lighthouse's address: --lighthouse, --start-lighthouse, --replica-id --------------------
def options(*argv: str) -> ReplicaOptions:
    parser = argparse.ArgumentParser()
    add_replica_options(parser)
    return replica_options(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "address",
    ["http://10.0.0.1:29510", "http://[::1]:1", "http://trainer-0.cluster_a.local:65535", "http://h:29510"],
)
def test_a_lighthouse_address_is_taken_as_given(address):
    opts = options("--lighthouse", address, "--replica-id", "group-b.1")
    assert opts == ReplicaOptions(address, False, 1, 29510, "group-b.1")
    assert opts.active and opts.env() == {LIGHTHOUSE_ENV: address, REPLICA_ENV: "group-b.1"}


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--lighthouse", "h:29510"], "--lighthouse h:29510: expected http://host:port"),
        (["--lighthouse", "https://h:29510"], "--lighthouse https://h:29510: expected http://host:port"),
        (["--lighthouse", "http://h"], "--lighthouse http://h: expected http://host:port"),
        (["--lighthouse", "http://h:1/quorum"], "--lighthouse http://h:1/quorum: expected http://host:port"),
        (["--lighthouse", "http://a b:1"], "--lighthouse http://a b:1: expected http://host:port"),
        (["--lighthouse", "http://h:0"], "--lighthouse http://h:0: the port must be in 1..65535"),
        (["--lighthouse", "http://h:65536"], "--lighthouse http://h:65536: the port must be in 1..65535"),
        (["--lighthouse", "http://h:1", "--start-lighthouse"], "--lighthouse and --start-lighthouse exclude"),
        (["--min-replicas", "2"], "--min-replicas needs --start-lighthouse"),
        (["--lighthouse-port", "9"], "--lighthouse-port needs --start-lighthouse"),
        (["--start-lighthouse", "--min-replicas", "0"], "--min-replicas must be at least 1, got 0"),
        (["--start-lighthouse", "--lighthouse-port", "70000"], "--lighthouse-port must be in 0..65535, got"),
        (["--replica-id", "a/b"], "--replica-id 'a/b': use letters, digits, '.', '_' or '-'"),
    ],
)
def test_a_lighthouse_option_that_cannot_work_is_refused_in_one_line(argv, said):
    with pytest.raises(LighthouseOptionError) as refused:
        options(*argv)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_a_lighthouse_to_start_needs_its_port_free():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            LighthouseOptionError, match=f"^--start-lighthouse: port {port} is already in use"
        ):
            options("--start-lighthouse", "--lighthouse-port", str(port))
        opts = options("--start-lighthouse", "--lighthouse-port", "0", "--min-replicas", "3")
    assert opts == ReplicaOptions(None, True, 3, 0, None)  # port 0: any free one, nothing to check
    assert opts.env(served_at="http://vm:41000") == {LIGHTHOUSE_ENV: "http://vm:41000"}
    assert not options().active and options().env() == {}


def test_a_lighthouse_on_this_machine_is_reached_by_name_one_over_a_network_by_its_route():
    for here in ("http://127.0.0.1:29510", "http://localhost:29510", "http://[::1]:29510", None):
        assert reach_host(here) is None
        assert advertised_host(here) == socket.gethostname()
    assert reach_host("http://no-such-host.invalid:29510") is None  # unresolvable: nothing to route by
    assert reach_host("http://10.0.0.1:29510") == "10.0.0.1"
    default = [r for r in ip_json("route", "show", "default") if r.get("gateway")]
    if not default:
        pytest.skip("no default route here to reach a networked lighthouse by")
    gateway = default[0]["gateway"]
    (route,) = ip_json("route", "get", gateway)
    assert advertised_host(f"http://{gateway}:29510") == route["prefsrc"]  # its address on that route


def _envs(world: int, here: int, **extra: str) -> dict[int, dict[str, str]]:
    return {
        r: {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **extra}
        for r in range(here)
    }


def test_the_store_port_is_held_against_every_other_program_but_rank_0s_store():
    hold = StorePortHold()
    envs = _envs(2, 2)
    hold.assign(envs)
    port = hold.port
    assert port is not None and {env["MASTER_PORT"] for env in envs.values()} == {str(port)}
    try:
        # The kernel hands it to no one (bind(0), as torch's get_free_port and every client's connect do)
        for _ in range(500):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] != port
        # A program binding it by number is refused
        with socket.socket() as thief, pytest.raises(OSError) as refused:
            thief.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        # Rank 0's store binds it (SO_REUSEADDR, as unison's and torch's TCPStore) and serves
        with socket.socket() as store:
            store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            store.bind(("127.0.0.1", port))
            store.listen(1)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        # The next attempt gets a port of its own, and the first is free again
        hold.assign(envs)
        assert hold.port != port and envs[0]["MASTER_PORT"] == str(hold.port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    finally:
        hold.release()
    assert hold.port is None


@pytest.mark.parametrize(
    "envs",
    [_envs(4, 2), _envs(2, 2, TORCHELASTIC_USE_AGENT_STORE="True"), {}],
    ids=["ranks-on-other-machines", "agent-store", "no-workers"],
)
def test_the_store_port_torch_agreed_is_kept_where_this_node_cannot_choose_it(envs):
    before = {r: dict(env) for r, env in envs.items()}
    hold = StorePortHold()
    hold.assign(envs)
    assert envs == before and hold.port is None

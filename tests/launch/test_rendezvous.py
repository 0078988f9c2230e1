"""The elastic rendezvous endpoint: a port held by a foreign program fails fast; a store's is fine."""

from __future__ import annotations

import socket
import stat
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hangs import run_or_report
from unison.launch.launcher import parse_options, plan_launch
from unison.launch.logs import RankLogsSpecs
from unison.launch.options import LaunchError
from unison.launch.rendezvous import check_rdzv_endpoint

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "probe.py"


@pytest.fixture
def foreign_listener():
    """A program that accepts connections on a port and never says a word (not a c10d store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.launch
def test_an_endpoint_port_held_by_another_program_fails_fast_saying_so(foreign_listener):
    port = foreign_listener
    cmd = [sys.executable, "-m", "unison.launch", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "20"]
    start = time.monotonic()
    proc = run_or_report([*cmd, str(PROBE)], 120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"port {port} on this machine is held by a program that is not a c10d rendezvous store" in proc.stderr
    )
    assert elapsed < 20  # it used to wait past 120 s with no message


def test_an_endpoint_port_held_by_this_jobs_store_is_accepted_another_jobs_refused():
    """Another node of the same job, started on this machine, hosts the rendezvous store there (its
    rendezvous key is in it): accepted. A store of another job (another run id, or a bare store)
    is refused naming the run id, instead of being joined."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    store.set("torch.rendezvous.job-a", "")  # what torch's c10d backend writes first, for run id job-a
    check_rdzv_endpoint(f"127.0.0.1:{store.port}", run_id="job-a")  # no error
    with pytest.raises(LaunchError, match="holds no rendezvous 'job-b'"):
        check_rdzv_endpoint(f"127.0.0.1:{store.port}", run_id="job-b", wait=1.0)


@pytest.mark.launch
def test_a_launch_on_another_jobs_store_is_refused_not_joined(tmp_path):
    """A TCPStore of another job listens on the endpoint's port: the launch used to join it and run to
    rc 0; it must refuse it before starting anything."""
    foreign = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    script = tmp_path / "train.py"
    script.write_text("print('RAN')\n")
    cmd = [
        sys.executable,
        "-m",
        "unison.launch",
        "--rdzv-endpoint",
        f"127.0.0.1:{foreign.port}",
        "--rdzv-id",
        "7",
    ]
    proc = run_or_report([*cmd, "--timeout", "20", str(script)], 120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RAN" not in proc.stdout
    assert (
        f"port {foreign.port} on this machine is held by a c10d store that holds no rendezvous '7'"
        in proc.stderr
    )


def test_a_free_endpoint_port_is_accepted(foreign_listener):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_rdzv_endpoint(f"127.0.0.1:{free}")
    with pytest.raises(LaunchError, match="not a c10d rendezvous store"):
        check_rdzv_endpoint(f"127.0.0.1:{foreign_listener}", wait=1.0)


def test_the_one_machine_rendezvous_file_is_private_to_the_user(tmp_path):
    plan = plan_launch(parse_options(["--nproc", "2", str(PROBE)]), str(tmp_path))
    path = Path(plan.config.rdzv_endpoint)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # torch's FileStore made it 0644
    finally:
        path.unlink()


def test_log_folders_and_files_are_private_to_the_user(tmp_path):
    specs = RankLogsSpecs(str(tmp_path / "logs"))
    envs = {r: {"RANK": str(r), "TORCHELASTIC_RESTART_COUNT": "0"} for r in (0, 1)}
    dest = specs.reify(envs)  # what torch's agent calls before it starts the workers
    attempt = tmp_path / "logs" / "attempt_0"
    assert stat.S_IMODE(attempt.stat().st_mode) == 0o700  # 0755 under the usual umask before
    files = [Path(f) for f in [*dest.stdouts.values(), *dest.stderrs.values()]]
    assert sorted(f.name for f in files) == [f"rank{r}.{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    with open(files[0], "w") as fh:  # torch's agent opens them so: the mode stays
        fh.write("x")
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600


@pytest.mark.launch
def test_a_node_that_never_comes_is_explained_not_an_empty_error(tmp_path):
    """torch raises RendezvousTimeoutError with no text when a node is lost or never starts: the
    launcher's line says what it means and which timeout ran out."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must never run')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "unison.launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    proc = run_or_report([*cmd, "--timeout", "3", str(script)], 90)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stderr.splitlines() if "Error" in x]
    assert line.startswith(
        "unison launch: RendezvousTimeoutError: the nodes did not all join the rendezvous within its timeout "
        "(3 s, --timeout): a node was lost or never started"
    ), proc.stderr
    assert "must never run" not in proc.stderr

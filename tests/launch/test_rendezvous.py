"""The elastic rendezvous endpoint: a port held by a foreign program fails fast; a store's is fine."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from unison.launch.launcher import parse_options, plan_launch
from unison.launch.rendezvous import check_rdzv_endpoint
from unison.launch.support import LaunchError, RankLogsSpecs

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "probe.py"


@pytest.fixture
def foreign_listener():
    """A program that accepts connections on a port and never says a word (not a c10d store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.slow
def test_an_endpoint_port_held_by_another_program_fails_fast_saying_so(foreign_listener):
    port = foreign_listener
    cmd = [sys.executable, "-m", "unison.launch", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "20"]
    start = time.monotonic()
    proc = subprocess.run([*cmd, str(PROBE)], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"port {port} on this machine is held by a program that is not a c10d rendezvous store" in proc.stderr
    )
    assert elapsed < 20  # it used to wait past 120 s with no message


def test_an_endpoint_port_held_by_a_store_is_accepted():
    # Another node of the same job, started on this machine, hosts the rendezvous store there.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    check_rdzv_endpoint(f"127.0.0.1:{store.port}")  # no error


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

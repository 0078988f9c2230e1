"""The elastic rendezvous endpoint: a port held by a foreign program fails fast; a store's is fine."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from unison.launch.rendezvous import check_rdzv_endpoint
from unison.launch.support import LaunchError

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

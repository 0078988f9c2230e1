"""Stall diagnosis where a collective never raises (NCCL): the heartbeat thread itself names the
missing rank and ends the process. On the CPU a gloo all-reduce with a long timeout stands in for
NCCL's (its watchdog would abort the process without a word); the NCCL run is in `make gpu-check`."""

import sys
import textwrap
import time

import pytest

from tests.hangs import run_or_report

pytestmark = pytest.mark.launch

SCRIPT = textwrap.dedent(
    """
    import datetime, os, time
    import torch, torch.distributed as dist
    from unison.distributed import setup_distrib
    from unison.distributed.watchdog import Watchdog

    setup_distrib(timeout=120)  # the collective's own timeout: far beyond the watchdog's
    dog = Watchdog(4.0, interval=0.5, exit_on_stall=True)
    dog.start()
    dog.progress(0, 0, 0, 0)
    if dist.get_rank() == 1:
        time.sleep(3)  # still beating, but its progress stays behind
        dog.progress(0, 0, 0, 1)
        time.sleep(120)
    for batch in range(1, 3):
        dog.progress(0, 0, batch, 0)
    dist.all_reduce(torch.ones(1))  # rank 1 never comes
    print("the all-reduce returned", flush=True)
    """
)


def test_a_blocked_rank_names_the_missing_one_and_exits(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(script)]
    proc = run_or_report(cmd, 110)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "the all-reduce returned" not in out
    assert "[unison] rank 0: RankStalledError: rank 1 stopped taking part" in out, out[-2000:]
    assert took < 60  # the watchdog's 4 s (+ start-up), not the collective's 120 s

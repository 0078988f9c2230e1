"""What both trainers share: the rank monitor names a rank that stopped even after the group is gone."""

import socket
import subprocess
import sys
import textwrap

import pytest

from tests.hangs import communicate_or_report

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch.distributed as dist
    from unison.distributed.joining import RankMonitor

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    monitor = RankMonitor(timeout=30)
    if rank == 1:  # joins, then dies before its first batch
        dist.barrier()
        sys.exit(0)
    monitor.progress(type("Learn", (), {"epoch": 0, "training": True, "iter": 3})(), 0)
    dist.barrier()
    # Ray Train tears its group down when a worker dies, before unison asks who stopped.
    dist.destroy_process_group()
    # Rank 1 says it left from its exit hook: on a loaded machine that can take seconds.
    found, deadline = monitor.diagnose(), time.monotonic() + 30
    while found is None and time.monotonic() < deadline:
        time.sleep(0.2)
        found = monitor.diagnose()
    print("diagnosis:", None if found is None else found.rank, found)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_the_rank_that_stopped_is_named_after_the_group_was_destroyed(tmp_path):
    # Processes of their own: destroying a default group must not touch the test session's pools.
    script, port = tmp_path / "monitor.py", str(_free_port())
    script.write_text(SCRIPT)
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    out = [communicate_or_report(p, 60)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], out
    assert out[0].startswith("diagnosis: 1 rank 1 left the training early"), out[0]

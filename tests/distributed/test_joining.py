"""What both trainers share: the rank monitor names a rank that stopped even after the group is gone."""

import socket
import subprocess
import sys
import textwrap

import pytest

from tests.hangs import communicate_or_report

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from unison.distributed.joining import RankMonitor

    rank, port, pid_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    monitor = RankMonitor(timeout=30)
    if rank == 1:  # joins, then dies before its first batch
        with open(pid_file, "w") as fh:
            fh.write(str(os.getpid()))
        dist.barrier()
        sys.exit(0)
    monitor.progress(type("Learn", (), {"epoch": 0, "training": True, "iter": 3})(), 0)
    dist.barrier()

    def ended(pid):  # gone, or a zombie its parent (the test) has not reaped yet
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    # Ray Train tears its group down when a worker has died (its exit hook run, which says it
    # left), before unison asks who stopped. Under load rank 1's exit can lag rank 0 by seconds.
    pid, deadline = int(open(pid_file).read()), time.monotonic() + 30
    while not ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()
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
    args = [port, str(tmp_path / "rank1.pid")]
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(r), *args], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    out = [communicate_or_report(p, 60)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], out
    assert out[0].startswith("diagnosis: 1 rank 1 left the training early"), out[0]


def test_dropout_that_drops_is_named_on_several_processes_only():
    import warnings

    from torch import nn

    from unison.distributed.joining import RankDrawnDropoutWarning, warn_rank_drawn_dropout

    model = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.0), nn.Sequential(nn.Dropout2d(0.25)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert warn_rank_drawn_dropout(model, 1) == ["2.0"]  # one process: its own stream is the run's
        assert warn_rank_drawn_dropout(nn.Sequential(nn.Dropout(0.0)), 3) == []
        assert warn_rank_drawn_dropout(model, 2) == ["2.0"]
    assert [type(w.message) for w in said] == [RankDrawnDropoutWarning]
    assert "dropout (2.0, p=0.25)" in str(said[0].message) and "2 processes" in str(said[0].message)

"""The worker bootstrap ends a script's process the way Python would, minus finalization.

Each case runs `python -m unison.launch.worker script` (what torch's agent runs for every rank)
as a real subprocess and checks what Python's own exit would have done.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, sys, threading, time

log = open(sys.argv[1], "w")  # a global file the script never closes
log.write("written, never flushed nor closed\\n")

def late_writer():
    time.sleep(0.3)
    with open(sys.argv[1] + ".thread", "w") as fh:
        fh.write("the thread finished\\n")

threading.Thread(target=late_writer).start()  # not a daemon: exit waits for it
atexit.register(lambda: print("atexit handler ran", flush=True))
print("script body ran")  # left in the buffer: stdout is a pipe here
how = sys.argv[2]
if how == "message":
    sys.exit("stopped: bad configuration")
if how == "status":
    sys.exit(7)
if how == "error":
    raise ValueError("broken on purpose")
"""


def run_worker(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "unison.launch.worker", str(script), str(out), how]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("how", "status", "stderr_has"),
    [
        ("normal", 0, ""),
        ("message", 1, "stopped: bad configuration"),
        ("status", 7, ""),
        ("error", 1, "ValueError: broken on purpose"),
    ],
)
def test_the_end_of_a_script_is_pythons(tmp_path: Path, how: str, status: int, stderr_has: str) -> None:
    proc = run_worker(tmp_path, how)
    assert proc.returncode == status, proc.stderr
    assert stderr_has in proc.stderr
    # What Python's exit does, in its order: threads joined, atexit run, files and console flushed.
    assert proc.stdout.splitlines() == ["script body ran", "atexit handler ran"]
    assert (tmp_path / "out.txt").read_text() == "written, never flushed nor closed\n"
    assert (tmp_path / "out.txt.thread").read_text() == "the thread finished\n"


def test_the_bootstrap_leaves_torchs_state_to_the_script(tmp_path: Path) -> None:
    """A plain torch script inherits no FSDP/DTensor/checkpoint imports from its launcher.

    With them loaded by the bootstrap, the torch tutorial's DDP script deadlocked at exit in
    torch's gloo group destructor about 1 launch in 3 (0 in 12 without; pytorch/pytorch#56297).
    """
    script = tmp_path / "probe.py"
    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    script.write_text(f"import sys\nprint([m for m in {heavy!r} if m in sys.modules])\n")
    proc = subprocess.run(
        [sys.executable, "-m", "unison.launch.worker", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

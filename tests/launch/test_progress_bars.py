"""Rank 0's progress bars under `unison launch` and `unison.spawn`, read from a real pseudo-terminal.

On a terminal the launcher draws rank 0's epoch and batch bars live (redrawn with carriage
returns, their batch count rising before the epoch's row is printed), and every other line, of
any rank, is written whole above them; through a pipe no bar is drawn at all.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.hangs import run_or_report

pytestmark = pytest.mark.launch  # real launches (and one unison.spawn)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "progress_bars.py")
WAIT_S = 120
COLUMNS = 100
STEPS = 6
TRAIN_BAR = re.compile(r"train:\s+\d+%\|[^|\n]*\|\s*(\d+)/" + str(STEPS))


def run_in_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` with stdout and stderr on a new pseudo-terminal COLUMNS wide; return its status and
    what it showed (the terminal's "\\r\\n" read back as "\\n")."""
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, COLUMNS, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown, deadline = bytearray(), time.monotonic() + WAIT_S
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(
                    f"{cmd} did not finish in {WAIT_S} s; it showed:\n{shown.decode(errors='replace')}"
                )
            if select.select([controller], [], [], 1.0)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: every process holding the terminal has ended
                    break
                if not chunk:
                    break
                shown += chunk
    finally:
        os.close(controller)
    return proc.wait(timeout=WAIT_S), shown.decode("utf-8", "replace").replace("\r\n", "\n")


def screen(shown: str) -> list[str]:
    """The lines a terminal shows after `shown` (what a user reads): carriage return, newline,
    erase to the end of the line and cursor up applied (the only controls the bars use), down to
    the cursor's row and any row below it that still holds text. A row below the cursor that was
    erased is blank screen, as if never written (the relay takes its bars off from the bottom up,
    leaving the cursor on their first row)."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[K|\x1b\[A|\r|\n|[^\x1b\r\n]+", shown):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\x1b[K":
            lines[row] = lines[row][:col]
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    while len(lines) > row + 1 and not lines[-1]:
        lines.pop()
    return lines


def check_bars_and_lines(shown: str) -> None:
    """Live bars before the epoch row; on the final screen rank 1's lines whole, on lines of their
    own, and no bar left but the finished epoch bar."""
    row = shown.find("[rank0] epoch     train_loss")
    assert row > 0, shown
    counts = [int(n) for n in TRAIN_BAR.findall(shown[:row])]
    # live: the batch bar was redrawn as training went, its count only rising, before the row
    assert len(set(counts)) >= 3 and counts == sorted(counts), (counts, shown)
    assert shown[:row].count("\repoch:") >= 3  # redrawn in place (carriage return), not new lines
    assert "[rank0] train:" not in shown and "[rank0] epoch:   0%" not in shown  # never forwarded as lines
    final = screen(shown)
    rank1 = [line for line in final if "RANK1" in line]
    assert rank1 == [f"[rank1] RANK1 line at step {k}" for k in range(STEPS)], "\n".join(final)
    assert not any("train:" in line or "epoch:" in line for line in final[:-2]), "\n".join(final)
    assert re.fullmatch(r"\[rank0\] epoch: 100%\|[^|]*\| 1/1 .*", final[-2]), final  # tqdm leaves it
    assert final[-1] == "", final  # and nothing is drawn below it


def test_launch_on_a_terminal_draws_rank0_bars_live_and_other_ranks_lines_whole():
    code, shown = run_in_terminal([sys.executable, "-m", "unison.launch", "--nproc", "2", SCRIPT])
    assert code == 0, shown
    check_bars_and_lines(shown)


def test_spawn_on_a_terminal_draws_rank0_bars_the_same_way():
    code, shown = run_in_terminal([sys.executable, SCRIPT, "--spawn"])
    assert code == 0, shown
    assert shown.endswith(f"RESULT {STEPS}\n")
    check_bars_and_lines(shown.removesuffix(f"RESULT {STEPS}\n"))


def test_launch_through_a_pipe_draws_no_bar():
    proc = run_or_report([sys.executable, "-m", "unison.launch", "--nproc", "2", SCRIPT], WAIT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert "[rank0] epoch     train_loss" in proc.stdout and "[rank1] RANK1 line at step 5" in proc.stdout
    assert "\r" not in both and "\x1b[" not in both and "train:" not in both and "epoch:" not in both, both


def test_a_restart_takes_the_dead_attempts_bars_off_and_draws_the_new_ones():
    """Rank 1 is killed at step 3 of the first attempt (rank 0's bars on screen), the launcher
    restarts both: its restart line stands on a line of its own, and no bar of the dead attempt stays."""
    cmd = [
        sys.executable,
        "-m",
        "unison.launch",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        SCRIPT,
        "--crash-at",
        "3",
    ]
    code, shown = run_in_terminal(cmd)
    assert code == 0, shown
    final = screen(shown)
    restart = [line for line in final if "restarting the workers" in line]
    assert len(restart) == 1 and restart[0].startswith(
        "unison launch: restarting the workers (restart 1 of 1)"
    )
    assert not any("train:" in line or "epoch:" in line for line in final[:-2]), "\n".join(final)
    assert re.fullmatch(r"\[rank0\] epoch: 100%\|[^|]*\| 1/1 .*", final[-2]), "\n".join(final)
    after = TRAIN_BAR.findall(shown[shown.index("restarting the workers") :])
    assert after[0] == "0", after  # the dead attempt's bar (at step 3) was not drawn again
    assert len(set(after)) >= 3  # the new attempt's bars, live again

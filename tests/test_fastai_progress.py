"""fastai's progress bar under `unison launch` (unison.fastai.progress): live on a terminal, one line per
epoch through a pipe.

fastprogress redraws its bar with carriage returns on any stdout; through torch's per-rank tailer
each redraw came out as a line of its own (86 lines for the script's three 25-batch epochs through a
pipe). The bridge swaps fastai's bar on rank 0 for one that the launcher's relay redraws in place,
and that writes nothing but fastai's table to a pipe or a file.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from tests.hangs import run_or_report
from tests.launch.test_progress_bars import run_in_terminal, screen

fastai_progress = pytest.importorskip("fastai.callback.progress")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "fastai_progress_script.py")
LAUNCH = [sys.executable, "-m", "unison.launch", "--nproc", "2", SCRIPT]
WAIT_S = 300
HEADER = "[rank0] epoch     train_loss  valid_loss  accuracy  time"
TRAIN_BAR = re.compile(r"train \|[█-]+\| [\d.]+% \[(\d+)/25 ")
BAR_TRACES = ("█", "Epoch 1/3", "/25 ", "train |", "valid |")  # any piece of a bar, fastprogress's or ours


def row(epoch: int) -> re.Pattern[str]:
    """fastai's table row for `epoch` (rank 0's): the epoch, three numbers, the time."""
    return re.compile(rf"\[rank0\] {epoch} +\d\.\d{{6}} +\d\.\d{{6}} +\d\.\d{{6}} +\d\d:\d\d *")


@pytest.mark.launch
def test_on_a_terminal_the_launcher_redraws_fastais_bars_in_place():
    code, shown = run_in_terminal(LAUNCH)
    assert code == 0, shown
    first_valid = shown.find("valid |")
    assert first_valid > 0, shown
    # live: the batch bar redrawn as the first epoch trained, its count rising (the datagrams keep
    # their order; the table's rows come later, through the tailer)
    counts = [int(n) for n in TRAIN_BAR.findall(shown[:first_valid])]
    assert len(set(counts)) >= 3 and counts == sorted(counts), (counts, shown)
    assert len(TRAIN_BAR.findall(shown)) >= 15  # three epochs' redraws, ...
    final = screen(shown)
    lines = "\n".join(final)
    # ... of which the scrollback keeps none: the table, rank 1's lines, a few launcher lines
    assert not any(trace in line for line in final for trace in BAR_TRACES), lines
    assert len(final) <= 24, lines  # 98 when every redraw was a line
    assert [line.rstrip() for line in final if line.startswith(HEADER)] == [HEADER], lines
    for epoch in range(3):
        assert len([line for line in final if row(epoch).fullmatch(line)]) == 1, lines  # rank 0's only
        assert f"[rank1] RANK1 epoch {epoch}" in final, lines  # other ranks' lines whole, above the bars
    assert "[rank0] DONE" in final and final[-1] == "", lines  # no bar left below the output


@pytest.mark.launch
def test_through_a_pipe_fastais_table_is_one_line_per_epoch_and_no_bar():
    proc = run_or_report(LAUNCH, WAIT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\r" not in proc.stdout + proc.stderr, proc.stdout
    assert not any(trace in proc.stdout + proc.stderr for trace in BAR_TRACES), proc.stdout
    lines = proc.stdout.splitlines()
    assert [line.rstrip() for line in lines if line.startswith(HEADER)] == [HEADER], proc.stdout
    for epoch in range(3):
        assert len([line for line in lines if row(epoch).fullmatch(line)]) == 1, proc.stdout
    # the header, three rows, the bridge's global-batch line, DONE (86 lines when each redraw was one)
    assert len(lines) <= 8, proc.stdout


@pytest.mark.launch
def test_fastais_no_logging_and_no_bar_keep_their_meaning_through_a_pipe():
    """fit(1) in learn.no_logging(): nothing printed; in learn.no_bar(): fastai's bare logger line;
    then fit(1) with the ProgressCallback fastai put back on leaving no_bar: the table, still no bar."""
    proc = run_or_report([*LAUNCH, "--idioms"], WAIT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\r" not in proc.stdout + proc.stderr, proc.stdout
    assert not any(trace in proc.stdout + proc.stderr for trace in BAR_TRACES), proc.stdout
    rank0 = [line.rstrip() for line in proc.stdout.splitlines() if line.startswith("[rank0]")]
    assert re.fullmatch(r"\[rank0\] unison\.fastai: global batch .*", rank0[0]), rank0
    assert re.fullmatch(r"\[rank0\] \[0, [\d.]+, [\d.]+, [\d.]+, '\d\d:\d\d'\]", rank0[1]), rank0  # no_bar
    assert rank0[2:4] == ["[rank0] AFTER no_bar", HEADER], rank0
    assert row(0).fullmatch(rank0[4]) and rank0[5:] == ["[rank0] DONE"], rank0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _learner():
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        from fastai_progress_script import build
    finally:
        sys.path.remove(str(ROOT / "tests" / "scripts"))
    return build(16)


def test_a_plain_terminal_keeps_fastais_bar_and_a_pipe_swaps_it_until_undone(monkeypatch):
    from unison.env_names import PROGRESS_SOCKET_ENV
    from unison.fastai.progress import LaunchProgressCallback, use_launch_progress

    monkeypatch.delenv(PROGRESS_SOCKET_ENV, raising=False)
    learn = _learner()
    stock = learn.progress
    monkeypatch.setattr(sys, "stdout", _Terminal())
    use_launch_progress(learn)()
    assert learn.progress is stock and type(stock) is fastai_progress.ProgressCallback  # live already

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe
    restore = use_launch_progress(learn)
    assert isinstance(learn.progress, LaunchProgressCallback) and stock not in learn.cbs
    with learn.no_bar():
        assert not any(isinstance(cb, fastai_progress.ProgressCallback) for cb in learn.cbs)
    learn.fit(1)  # the callback fastai put back on leaving no_bar is swapped as the fit starts
    assert isinstance(learn.progress, LaunchProgressCallback)
    assert [type(cb) for cb in learn.cbs].count(LaunchProgressCallback) == 1
    printed = sys.stdout.getvalue().splitlines()
    assert [line.split() for line in printed][0] == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    assert len(printed) == 2 and "\r" not in sys.stdout.getvalue(), printed
    restore()
    assert learn.progress is stock and stock in learn.cbs
    assert not any(isinstance(cb, LaunchProgressCallback) for cb in learn.cbs)

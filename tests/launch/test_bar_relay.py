"""`BarRelay` in-process: what a terminal shows after the relay drew, erased and redrew rank 0's bars.

The terminal is a string read back with the same emulation the launched tests use
(`tests.launch.test_progress_bars.screen`); the launched runs are in that module.
"""

from __future__ import annotations

import io

from tests.launch.test_progress_bars import screen
from unison.launch.bar_relay import BarRelay


def test_a_row_left_blank_below_the_cursor_is_not_part_of_the_screen() -> None:
    """Two bar lines drawn, then erased from the bottom up: the cursor ends on the first, and the
    second is a blank row below it, which a terminal shows as nothing. A row below the cursor that
    still holds text is shown."""
    assert screen("done\n\rbar1\x1b[K\nbar2\x1b[K\r\x1b[K\x1b[A\r\x1b[K") == ["done", ""]
    assert screen("a\nb\x1b[A\r") == ["a", "b"]


def test_a_last_line_forwarded_before_the_bars_last_frame_leaves_no_bar_and_no_blank_row() -> None:
    """Under load the last line of rank 0 (the finished epoch bar, as a line) can reach the relay
    before the datagram that takes the live bars down: the relay draws the two stale bars below the
    line, then takes them off as the launch ends. The screen is the line and the cursor's empty row
    below it (a full `make test` beside a second copy once read a third, blank row there)."""
    terminal = io.StringIO()
    relay = BarRelay(terminal)
    try:
        line, bars = (
            "[rank0] epoch: 100%|##########| 1/1",
            ["epoch:   0%|          | 0/1", "train:  50%|###   | 3/6"],
        )
        relay.show(bars)
        relay.forward(terminal, line + "\n")
        assert screen(terminal.getvalue()) == [line, *bars]  # the stale bars, drawn again below it
        relay.clear()
    finally:
        relay.close()
    assert screen(terminal.getvalue()) == [line, ""]

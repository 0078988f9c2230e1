"""fastai's progress bar under `unison launch`: live on the launcher's terminal, one line per epoch in a log.

fastai's `ProgressCallback` draws with fastprogress, which redraws its bar with carriage returns on
stdout (and does so whether stdout is a terminal or not). Under `unison launch` rank 0's stdout is a
file that torch's tailer forwards a line at a time, so every redraw lands as a new line in the
scrollback or the log. `use_launch_progress(learn)` swaps it, on rank 0, for `LaunchProgressCallback`,
which times its bars with fastprogress's own `ProgressBar` but draws them where they belong:

- when the launcher draws bars (`PROGRESS_SOCKET_ENV` set: its stderr is a terminal), each redraw of
  the epoch bar and the batch bar goes to it through `send_bars`, and it redraws them in place below
  the forwarded output, as it does for unison's own `ProgressCallback`;
- otherwise (the output is a pipe or a file) no bar is written at all.

Either way fastai's table (the header, then one row per epoch, from fastai's Recorder) is printed on
stdout as fastai prints it. A plain run on a terminal keeps fastai's own bar, which is live there.

    restore = use_launch_progress(learn)   # rank 0, inside `to_distributed`
    learn.fit(3)
    restore()                              # fastai's own ProgressCallback is back (`detach_distributed`)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from fastai.callback.core import Callback
from fastai.callback.progress import ProgressCallback
from fastai.imports import noop  # fastai's own, the one `no_logging` sets (not fastcore's)
from fastprogress.fastprogress import ProgressBar

from unison.bar_sender import send_bars
from unison.callbacks.progress import launcher_columns, relayed

__all__ = ["LaunchProgressCallback", "use_launch_progress"]

_FILL, _EMPTY = "█", "-"  # fastprogress's console characters, so the bar looks like fastai's
_DEFAULT_COLUMNS = 100  # fastprogress's own width when it cannot read the terminal's


def use_launch_progress(learn: Any) -> Callable[[], None]:
    """On rank 0 of a launch, replace fastai's `ProgressCallback` on `learn` by `LaunchProgressCallback`.

    The swap happens when the launcher draws the bars (`PROGRESS_SOCKET_ENV` is set) or when stdout
    is not a terminal (a pipe, a file, or torch's tailer without a relay); on a plain terminal, or
    on a Learner without fastai's bar (another rank, or inside `learn.no_bar()`), nothing changes.
    Returns the function that undoes it: fastai's own callback back in its place.

        restore = use_launch_progress(learn)
    """
    stock = [cb for cb in learn.cbs if type(cb) is ProgressCallback]
    if not stock or not (relayed() or not _is_terminal(sys.stdout)):
        return lambda: None
    for cb in stock:
        _swap(learn, cb)
    keeper = _KeepLaunchProgress()
    learn.add_cb(keeper)

    def restore() -> None:
        ours = (LaunchProgressCallback, _KeepLaunchProgress)
        learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ours)])
        if not any(type(cb) is ProgressCallback for cb in learn.cbs):
            for cb in stock:
                cb.run = True  # the keeper may have benched it, had it come back through no_bar
            learn.add_cbs(stock)
        if relayed():
            send_bars([])  # a fit that raised left its bars on the launcher's screen

    return restore


class LaunchProgressCallback(ProgressCallback):
    """fastai's `ProgressCallback` for a launched rank 0: bars to the launcher's relay (if it has one)
    and never to stdout; fastai's table on stdout, one line per epoch.

    It answers to fastai's name for the bar (`learn.progress`), so `learn.no_bar()` removes it, and
    honours `learn.no_logging()` (no table) and `learn.no_mbar()` (no epoch bar, no table).
    """

    mbar: ProgressBar | None = None  # the epoch bar (fastai's master bar), during a fit
    pbar: ProgressBar | None = None  # the batch bar of the loader being run
    _names: list[str] | None = None  # the table's header, padded as fastprogress pads it

    @property
    def name(self) -> str:
        return "progress"  # fastai's own: `learn.progress`, which `no_bar` takes off

    def before_fit(self) -> None:
        assert hasattr(self.learn, "recorder")
        self._names = None
        self.mbar = _Bar(range(self.n_epoch), self._show, "Epoch") if self.create_mbar else None
        if self.mbar is not None:
            self.mbar.update(0)  # starts its clock (a resumed fit's first epoch is past 0)
        if self.learn.logger != noop:
            self.old_logger, self.learn.logger = self.logger, self._write_stats
            self._write_stats(self.recorder.metric_names)
        else:
            self.old_logger = noop

    def before_epoch(self) -> None:
        if self.mbar is not None:
            self.mbar.label = f"Epoch {self.epoch + 1}/{self.n_epoch}"
            self.mbar.update(self.epoch)

    def _launch_pbar(self) -> None:
        self.pbar = _Bar(self.dl, self._show, "train" if self.training else "valid")
        self.pbar.update(0)

    def after_batch(self) -> None:
        if self.pbar is None:
            return
        self.pbar.update(self.iter + 1)
        if hasattr(self, "smooth_loss"):
            self.pbar.comment = f"{self.smooth_loss.item():.4f}"

    def _end_pbar(self) -> None:
        self.pbar = None
        self._show()

    after_train = after_validate = _end_pbar

    def after_fit(self) -> None:
        self.mbar = self.pbar = None
        self._show()  # fastai leaves no bar behind on a terminal: the table is the record
        if hasattr(self, "old_logger"):
            self.learn.logger = self.old_logger

    def _write_stats(self, log: Sequence[Any]) -> None:
        if self.mbar is not None:
            print(self._row([f"{v:.6f}" if isinstance(v, float) else str(v) for v in log]), flush=True)

    def _row(self, cells: list[str]) -> str:
        """One line of fastai's console table: the first call is the header (each name padded to 8),
        later ones rows whose cells line up under it."""
        if self._names is None:
            self._names = [cell.ljust(8) for cell in cells]
            return "  ".join(self._names)
        return "".join(cell.ljust(len(name) + 2) for cell, name in zip(cells, self._names, strict=False))

    def _show(self) -> None:
        if relayed():
            send_bars([bar.line for bar in (self.mbar, self.pbar) if bar is not None and bar.line])


class _Bar(ProgressBar):
    """A fastprogress bar (its timing, its throttled redraws, its text) whose redraw is a line kept
    in `line` and handed to `show`, never printed."""

    def __init__(self, gen: Any, show: Callable[[], None], label: str = "") -> None:
        super().__init__(gen, leave=False)
        self.show, self.label, self.line = show, label, ""

    def on_update(self, val: int, text: str) -> None:
        columns = launcher_columns(_DEFAULT_COLUMNS)
        room = columns - 1 - len(self.label) - len(text) - 4  # the relay cuts a line at columns - 1
        length = max(min(columns - 60, room), 10)
        filled = int(length * val // self.total) if self.total else 0
        self.line = f"{self.label} |{_FILL * filled}{_EMPTY * (length - filled)}| {text}".lstrip()
        self.show()

    def update_graph(self, *args: Any, **kwargs: Any) -> None:
        """fastai's ShowGraphCallback draws on the master bar: on a console there is no graph."""


class _KeepLaunchProgress(Callback):
    """Keeps the swap when fastai puts its own callback back: `learn.no_bar()` adds a new fastai
    `ProgressCallback` on its way out. At the start of each fit (after the Recorder, before fastai's
    bar, order 60) any such callback is swapped too, and sits this fit out."""

    order = 59

    def before_fit(self) -> None:
        for cb in [cb for cb in self.learn.cbs if type(cb) is ProgressCallback]:
            # This fit's event list holds it already: with `run` off it skips every event of the fit.
            cb.run = False
            _swap(self.learn, cb)("before_fit")  # the new one is not in that list: its first event here


def _swap(learn: Any, stock: ProgressCallback) -> LaunchProgressCallback:
    """Put a `LaunchProgressCallback` in `stock`'s place on `learn`; return it."""
    learn.remove_cb(stock)
    replacement = LaunchProgressCallback()
    learn.add_cb(replacement)
    return replacement


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

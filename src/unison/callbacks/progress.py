"""`ProgressCallback`: tqdm bars for epochs and batches, on rank 0 only.

On a terminal the bars are tqdm's own. Under `unison launch` (or `unison.spawn` from a terminal)
rank 0's stderr is a log file that the launcher forwards line by line; when the launcher's own
stderr is a terminal it says so (`unison.launch.bar_relay.PROGRESS_SOCKET_ENV`), and rank 0 sends
each redraw of its bars to the launcher, which draws them below the forwarded lines. Otherwise
(output to a file or a pipe) no bar is drawn, so logs stay clean.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from unison.bar_sender import send_bars
from unison.data.stream import loader_length
from unison.env_names import PROGRESS_COLUMNS_ENV, PROGRESS_SOCKET_ENV
from unison.events import Callback


def relayed() -> bool:
    """True when the launcher draws rank 0's bars on its terminal (this rank's output is a file)."""
    return bool(os.environ.get(PROGRESS_SOCKET_ENV))


def launcher_columns(default: int) -> int:
    """The launcher terminal's width, as the launcher passed it; `default` where it passed none."""
    columns = os.environ.get(PROGRESS_COLUMNS_ENV, "")
    return int(columns) if columns.isdigit() and int(columns) > 20 else default


class ProgressCallback(Callback):
    """An epoch bar and a batch bar showing the running loss.

    `show=None` shows bars only when stderr is a terminal, or when the launcher's is (logs
    stay clean); `True` forces them, `False` hides them. Other ranks never show bars.

        learn = Learner(dls, model, loss_func, cbs=[])   # default: ProgressCallback(show=None)
    """

    order = 60

    def __init__(self, show: bool | None = None, refresh_s: float = 0.2):
        self.show = show
        self.refresh_s = refresh_s
        self.active = False
        self._epoch_bar: tqdm | None = None
        self._bar: tqdm | None = None
        self._sinks: list[_RelayedBar] = []  # the bars the launcher draws (relayed mode), top first

    def _enabled(self) -> bool:
        if not self.learn.collective.is_main:
            return False
        if self.show is None:
            return sys.stderr.isatty() or relayed()
        return self.show

    def _new_bar(self, **kwargs: object) -> tqdm:
        if not relayed():
            return tqdm(dynamic_ncols=True, **kwargs)
        sink = _RelayedBar(self._send)
        self._sinks.append(sink)
        bar = tqdm(file=sink, ncols=launcher_columns(80) - 1, **kwargs)  # (the relay cuts at columns - 1)
        sink.bar = bar
        return bar

    def _send(self) -> None:
        send_bars([sink.frame for sink in self._sinks if sink.frame])

    def _drop(self, bar: tqdm) -> None:
        """Close `bar`; relayed, take it off the launcher's screen."""
        bar.close()
        kept = [sink for sink in self._sinks if sink.bar is not bar]
        if len(kept) != len(self._sinks):
            self._sinks = kept
            self._send()

    def before_fit(self) -> None:
        self.active = self._enabled()
        if self.active:
            self._epoch_bar = self._new_bar(
                total=self.learn.n_epoch, initial=self.learn.start_epoch, desc="epoch", leave=True
            )

    def _open(self, desc: str) -> None:
        if self._enabled():
            self.active = True
            self._bar = self._new_bar(total=loader_length(self.learn.dl), desc=desc, leave=False)
            self._last = 0.0

    def before_train(self) -> None:
        self._open("train")

    def before_validate(self) -> None:
        self._open("valid")

    def after_batch(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.perf_counter()
        if self.learn.training and self.learn.loss is not None and now - self._last > self.refresh_s:
            self._last = now  # the loss read is a host sync: not on every batch
            self._bar.set_postfix(loss=f"{float(self.learn.loss):.4f}", refresh=False)

    def _close(self) -> None:
        if self._bar is not None:
            self._drop(self._bar)
            self._bar = None

    def after_train(self) -> None:
        self._close()

    def after_validate(self) -> None:
        self._close()
        if self._epoch_bar is None:
            self.active = False

    def after_epoch(self) -> None:
        if self._epoch_bar is not None:
            self._epoch_bar.update(1)

    def after_fit(self) -> None:
        self._close()
        if self._epoch_bar is not None:
            self._epoch_bar.close()  # its last redraw: the finished bar
            final = self._sinks[0].frame if self._sinks else ""
            self._drop(self._epoch_bar)
            if final:  # tqdm leaves the epoch bar on a terminal: relayed, it stays as a line of rank 0's,
                print(final, file=sys.stdout, flush=True)  # after the table's rows (one file keeps order)
            self._epoch_bar = None
        self.active = False

    def write(self, line: str) -> None:
        tqdm.write(line, file=sys.stdout)


class _RelayedBar:
    """The file one tqdm bar draws on when the launcher draws it: keeps its latest line.

    tqdm redraws a bar as "\\r" + line (+ padding), and moves between nested bars with newlines
    and cursor-up codes, which mean nothing here; each flush sends every bar's latest line."""

    encoding = "utf-8"

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self.frame = ""
        self.bar: tqdm | None = None

    def write(self, text: str) -> int:
        if "\r" in text:
            self.frame = text.rsplit("\r", 1)[-1].replace("\x1b[A", "").replace("\n", "").rstrip()
        return len(text)

    def flush(self) -> None:
        self._send()

    def isatty(self) -> bool:
        return False

"""Rank 0's progress bars on the launcher's terminal: `BarRelay`, the launcher's side (rank 0's is
`unison.bar_sender.send_bars`).

Under `unison launch` (and `unison.spawn` called from a terminal) every worker's output reaches the
console through torch's tailer, a line at a time and prefixed with the rank. A tqdm bar redraws one
line with carriage returns: through the tailer each redraw would come out as a new prefixed line,
torn by the other ranks' lines. So when the launcher's stderr is a terminal it opens a datagram
socket in a private folder and tells the workers where (`PROGRESS_SOCKET_ENV`) and how wide the
terminal is (`PROGRESS_COLUMNS_ENV`); rank 0's `ProgressCallback` sends each redraw of its bars
there (`send_bars`), and the relay draws them on the terminal's last lines. Every forwarded line,
of any rank or of the launcher itself, first erases the bars, is written whole, and the bars are
drawn again below it: no line ever lands inside a bar. When stderr is not a terminal nothing is set
and the bars stay out of the logs (the callback shows them only on a terminal).

    relay = BarRelay.for_terminal(sys.stderr)           # None unless stderr is a terminal
    with relay.console():
        run_workers(env=relay.env())                    # their output goes through sys.stdout/err
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import TextIO

from unison.env_names import PROGRESS_COLUMNS_ENV, PROGRESS_SOCKET_ENV

_ERASE_LINE = "\r\x1b[K"
_UP = "\x1b[A"

__all__ = ["BarRelay", "StandIn"]


class BarRelay:
    """Draws the bars rank 0 sends below the forwarded output, on the terminal `terminal`.

    >>> relay = BarRelay(sys.stderr)
    >>> relay.env()["UNISON_PROGRESS_COLUMNS"]
    '80'
    """

    def __init__(self, terminal: TextIO) -> None:
        self._terminal = terminal
        self._lock = threading.RLock()  # the tailers' threads and the receiver draw on one screen
        self._frames: list[str] = []
        self._drawn = 0  # bar lines on the screen now (the cursor ends on the last one)
        self._open_line = False  # the last forwarded text did not end its line
        self._folder = tempfile.mkdtemp(prefix="unison-bars-")  # 0700: only this user can send
        self.address = os.path.join(self._folder, "bars")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.address)
        self._socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_terminal(cls, stream: TextIO) -> BarRelay | None:
        """A relay drawing on `stream` if it is a terminal (and the platform has Unix sockets), else None."""
        try:
            usable = stream.isatty() and hasattr(socket, "AF_UNIX")
        except (AttributeError, ValueError):
            usable = False
        return cls(stream) if usable else None

    def columns(self) -> int:
        """The terminal's width now (80 if it cannot be read)."""
        try:
            return os.get_terminal_size(self._terminal.fileno()).columns or 80
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            return 80

    def env(self) -> dict[str, str]:
        """The variables that tell rank 0 to send its bars here."""
        return {PROGRESS_SOCKET_ENV: self.address, PROGRESS_COLUMNS_ENV: str(self.columns())}

    @contextlib.contextmanager
    def console(self) -> Iterator[None]:
        """While inside, sys.stdout and sys.stderr forward through the relay, and bars are received."""
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Relayed(saved[0], self), _Relayed(saved[1], self)
        self._thread = threading.Thread(target=self._receive, name="unison-bar-relay", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
            self.clear()
            sys.stdout, sys.stderr = saved
            self.close()

    def close(self) -> None:
        """Close the relay's socket and remove its folder (`console` does it on the way out)."""
        self._socket.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def forward(self, stream: TextIO, text: str) -> None:
        """Write `text` (forwarded output) on `stream` above the bars."""
        with self._lock:
            self._erase()
            stream.write(text)
            stream.flush()
            if text:
                self._open_line = not text.endswith("\n")
            if not self._open_line:
                self._draw()

    def show(self, frames: list[str]) -> None:
        """Draw `frames` (one line per bar, top to bottom) in place of the bars shown now."""
        with self._lock:
            if frames == self._frames and (self._drawn or not frames):
                return  # tqdm flushes every bar when one moves: nothing changed on screen
            self._erase()
            self._frames = frames
            self._draw()

    def clear(self) -> None:
        """Take the bars off the screen (rank 0 ended or was restarted: they are stale)."""
        self.show([])

    def _erase(self) -> None:
        if self._drawn:
            self._terminal.write(_ERASE_LINE + (_UP + _ERASE_LINE) * (self._drawn - 1))
            self._terminal.flush()
            self._drawn = 0

    def _draw(self) -> None:
        if not self._frames:
            return
        if self._open_line:  # a line still being written: end it rather than write into it
            self._terminal.write("\n")
            self._open_line = False
        width = max(self.columns() - 1, 10)  # never wrap: erasing counts lines
        lines = [frame[:width] for frame in self._frames]
        self._terminal.write("\r" + "\x1b[K\n".join(lines) + "\x1b[K")
        self._terminal.flush()
        self._drawn = len(lines)

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(Exception):  # a bad datagram must not end the relay
                self.show([line for line in data.decode("utf-8", "replace").split("\n") if line.strip()])


class StandIn(io.TextIOBase):
    """A text stream standing in for `stream` (sys.stdout or sys.stderr): what is not written goes
    to it. `_Relayed` here and the launcher's console guard (`launch.logs`) build on it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # typeshed: a plain attribute; io's a property
        return getattr(self._stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


class _Relayed(StandIn):
    """sys.stdout or sys.stderr while a relay draws bars: every write goes above them."""

    def __init__(self, stream: TextIO, relay: BarRelay) -> None:
        super().__init__(stream)
        self._relay = relay
        self._pid = os.getpid()

    def write(self, text: str) -> int:
        if os.getpid() != self._pid:  # a worker forked by spawn: its output goes to its log file as is
            return self._stream.write(text)
        self._relay.forward(self._stream, text)
        return len(text)

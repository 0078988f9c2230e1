"""Rank 0's half of the launcher's bar relay (`unison.launch.bar_relay`): `send_bars` sends each
redraw of its progress bars to the socket the launcher named in `PROGRESS_SOCKET_ENV`. Training
code imports this, not the launcher.
"""

from __future__ import annotations

import contextlib
import os
import socket

from unison.env_names import PROGRESS_SOCKET_ENV

__all__ = ["send_bars"]

_sender: socket.socket | None = None


def send_bars(frames: list[str]) -> bool:
    """Send rank 0's bars (one line each; [] takes them off) to the launcher's relay, if it has one.

    Never blocks and never raises: a bar the relay cannot take now is dropped (the next one
    replaces it anyway). Returns False when no relay listens (`PROGRESS_SOCKET_ENV` unset).

    >>> send_bars(["epoch:  50%|#####     | 1/2", "train:  25%|##        | 4/16"])
    False
    """
    global _sender
    address = os.environ.get(PROGRESS_SOCKET_ENV)
    if not address:
        return False
    if _sender is None:
        _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sender.setblocking(False)
    with contextlib.suppress(OSError):  # the relay ended, or its queue is full
        _sender.sendto("\n".join(frames).encode("utf-8", "replace"), address)
    return True

"""A deadline for a call that has none of its own.

A c10d store client call (`TCPStore.set`, `get`, `compare_set`) blocks for as long as the
server's host keeps the connection open without answering: a frozen (SIGSTOPped) process, or a
machine behind a cut link, holds it for as long as the freeze or the cut lasts. Shutting down and
diagnosing must not wait on that, so such calls run through `within`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def within(limit_s: float, call: Callable[[], T], what: str = "the store") -> T:
    """Return `call()`, run in a daemon thread, if it ends within `limit_s` seconds.

    Raises `TimeoutError` past the limit (the thread is left behind, blocked in its call, and
    ends with the process) and re-raises `call`'s own error.

        within(5.0, lambda: store.get("key"))
    """
    result: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # re-raised in the caller
            failed.append(exc)

    worker = threading.Thread(target=run, name="unison-bounded-call", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise TimeoutError(f"{what} did not answer within {limit_s:g} s")
    if failed:
        raise failed[0]
    return result[0]

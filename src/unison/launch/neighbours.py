"""Other `unison launch` jobs on this machine: their workers share the cores with ours.

Each launch gives its workers `floor(usable cores / processes)` threads. Several launches on one
machine (torchft replica groups, two experiments) would each divide the cores by their own count
and together oversubscribe them, so a launch counts the workers the others already run (their
`python -m unison.launch.worker` processes, read from /proc) and divides by the total. Launches
started at the same instant may not see each other yet; `OMP_NUM_THREADS` then decides.

    other_launches()          # {launcher pid: its workers}, on a machine running one other launch
"""

from __future__ import annotations

import os
from collections import Counter

__all__ = ["other_launches", "sharing_note"]

_WORKER = b"unison.launch.worker"


def other_launches(own_pid: int | None = None) -> dict[int, int]:
    """{launcher pid: worker count} of the `unison launch` jobs running here besides `own_pid`'s
    (this process by default). Empty where /proc cannot be read (not Linux)."""
    own = os.getpid() if own_pid is None else own_pid
    found: Counter[int] = Counter()
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return {}
    for pid in entries:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if _WORKER in argv and parent != own:
            found[parent] += 1
    return dict(found)


def sharing_note(others: dict[int, int], own: int, threads: int) -> str | None:
    """The launcher's one line about the other launches its workers share the cores with, or None.

    >>> sharing_note({48213: 2}, own=1, threads=1)[:68]
    'unison launch: note: 1 other launch here runs 2 worker(s); the cores'
    """
    if not others:
        return None
    workers = sum(others.values())
    launches = "1 other launch here runs" if len(others) == 1 else f"{len(others)} other launches here run"
    return (
        f"unison launch: note: {launches} {workers} worker(s); the cores are shared among all "
        f"{workers + own} ({threads} thread(s) each; OMP_NUM_THREADS chooses)"
    )

"""Keep each launched worker's default process group alive until the process ends.

torch's gloo group destructor joins the group's threads while holding the GIL. Each allreduce
that DDP starts inside `backward()` carries a copy of the backward's thread-local state, which
holds the Python `contextvars` context (`torch.autograd.graph._engine_run_backward` stashes it),
so a gloo thread freeing that collective needs the GIL. When a script calls
`destroy_process_group()` while its DDP model is alive, as pytorch/examples'
`multigpu_torchrun.py` does, DDP's `Reducer` can hold the group's last reference (most runs
something else still holds one then), and freeing DDP then runs the destructor: the main
thread waits for the gloo thread, which waits for the GIL, and the rank hangs after its last
line (pytorch/pytorch#56297; 4 launches in 12 of that tutorial with FSDP imported before the
group, 1 in 5 with `torch._dynamo` preloaded).

A worker that holds its own reference to each default group never runs that destructor from
the script: `destroy_process_group()` still deregisters the group (a later `init_process_group`
makes a new one), and the group's threads end with the process, which `unison launch` ends with
`os._exit` (`launch.worker.end_process`), without finalization. So the keeper is a thread that
looks every `interval` seconds for a default group it has not seen and keeps it: a group that
lives less than that may be missed (a script that made and destroyed it that fast). It is a
bare `_thread` thread, which `threading.enumerate()` does not list and exit does not join: the
script sees the threads a plain interpreter would.

>>> keeper = GroupKeeper(interval=0.02).start()  # done by `launch.worker.main` for every rank
>>> kept_groups()  # what the running keeper holds: none before the script makes a group
[]
"""

from __future__ import annotations

import _thread
import sys
import time

__all__ = ["GroupKeeper", "kept_groups"]

_running: GroupKeeper | None = None


class GroupKeeper:
    """A thread that keeps a reference to every default process group this process makes."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.kept: list[object] = []  # the groups, in the order they were made

    def start(self) -> GroupKeeper:
        """Start looking; this becomes the keeper `kept_groups` reports on."""
        global _running
        _thread.start_new_thread(self._run, ())
        _running = self
        return self

    def look(self) -> None:
        """Keep the live default group if it is a new one. Imports nothing: a script that never
        imports `torch.distributed` costs this a dictionary lookup."""
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        group = dist.group.WORLD
        if group is not None and not any(group is seen for seen in self.kept):
            self.kept.append(group)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                self.look()
            except Exception:  # noqa: BLE001  (mid-init or mid-destroy: the next look sees it)
                continue


def kept_groups() -> list[object]:
    """The default groups the running keeper holds, oldest first (empty where none runs: a
    process not started by `unison launch`)."""
    return list(_running.kept) if _running is not None else []

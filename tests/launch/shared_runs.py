"""A reference run made once for the whole test session, read by every module and xdist worker that asks.

Several test modules compare against the same reference run: `single_machine` (train_tiny.py on one
machine, `--nproc 2`) is read by test_multinode.py and test_kubernetes.py, `uninterrupted`
(cluster_job.py with nothing done to it) by test_cluster_faults.py and test_kubernetes.py. Each
run is a launch (an agent and two workers, about 5 CPU-s before the first step) whose result is a
few numbers, the same whichever module asks. `once_per_session` runs it once and keeps the result:
in this process for the modules that follow, and, under pytest-xdist, in the session's shared
temporary folder, so that a second worker reads it instead of launching it again (a worker that
asks while another runs it waits on the lock: idle, not CPU). Each session (each copy of the
suite) has its own folder, so a result never outlives the session that made it, and a failed run
writes nothing: the next asker runs it again and fails with its own message.

    >>> once_per_session("answer", tmp_path_factory, lambda folder: 42)  # doctest: +SKIP
    42
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

_made: dict[str, Any] = {}  # this process's results, by name


def once_per_session(name: str, tmp_path_factory: pytest.TempPathFactory, run: Callable[[Path], Any]) -> Any:
    """`run(folder)`'s result (JSON-serialisable), computed once per test session under `name`."""
    if name in _made:
        return _made[name]
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing to share beyond it
        _made[name] = run(tmp_path_factory.mktemp(name))
        return _made[name]
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above each worker's own
    kept = shared / f"shared-run-{name}.json"
    with FileLock(str(kept) + ".lock"):
        if kept.exists():
            _made[name] = json.loads(kept.read_text())
        else:
            _made[name] = run(tmp_path_factory.mktemp(name))
            kept.with_suffix(".part").write_text(json.dumps(_made[name]))
            kept.with_suffix(".part").rename(kept)
    return _made[name]

"""What `unison launch` reads into a failure (unison.launch.failures): which errors a restart meets
again, the OOM killer's count of the worker's own memory cgroup, the restart line's place."""

from __future__ import annotations

import pytest

from unison.launch.failures import deterministic_failure


@pytest.mark.parametrize(
    "headline,why",
    [
        ("OSError: [Errno 30] Read-only file system: '/ckpt/models'", "read-only file system (errno 30)"),
        (
            "PermissionError: [Errno 13] Permission denied: '/ckpt/models/checkpoint.pth'",
            "permission denied (errno 13)",
        ),
        ("CheckpointError: /ckpt/models/checkpoint.pth is damaged or truncated", "CheckpointError"),
        ("unison.checkpoint.errors.CheckpointError: the checkpoint holds another model", "CheckpointError"),
        ("DiskFullError: disk full (ENOSPC; OSError: [Errno 28] No space left on device)", "DiskFullError"),
        ("NonFiniteError: non-finite loss (nan) at epoch 0, step 3", "NonFiniteError"),
        ("ModuleNotFoundError: No module named 'trainlib'", "ModuleNotFoundError"),
        ("OSError: [Errno 28] No space left on device", "no space left (errno 28)"),
    ],
)
def test_errors_a_restart_meets_again_are_named(headline, why):
    assert deterministic_failure(headline) == why


@pytest.mark.parametrize(
    "headline",
    [
        "RuntimeError: Connection reset by peer",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "RankStalledError: rank 1 stopped taking part: no heartbeat for 10 s",
        "ValueError: a CheckpointError-free message",
        "",
    ],
)
def test_errors_a_restart_may_get_past_are_not(headline):
    assert deterministic_failure(headline) is None

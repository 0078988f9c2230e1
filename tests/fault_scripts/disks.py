"""A small tmpfs for tests that need a disk that really fills up (root only; skipped elsewhere)."""

import contextlib
import subprocess

import pytest

from unison.checkpoint.format import free_bytes


@contextlib.contextmanager
def small_disk(mount, size="1m"):
    mount.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(folder, leave):
    """Fill `folder`'s file system until `leave` bytes are free."""
    (folder / "filler").write_bytes(b"\0" * (free_bytes(folder) - leave))
    assert abs(free_bytes(folder) - leave) <= 4096

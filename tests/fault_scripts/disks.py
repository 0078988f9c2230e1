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


@contextlib.contextmanager
def read_only(folder):
    """`folder` made read-only for every process, root included (a read-only bind mount of itself):
    writing into it fails with `OSError: [Errno 30] Read-only file system`. Skipped where no mount can
    be made (not root)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount a folder here: {done.stderr.decode().strip()}")
    try:
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a bind mount read-only here: {done.stderr.decode().strip()}")
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)

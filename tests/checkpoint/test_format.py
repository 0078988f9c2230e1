"""Checkpoint files on a hostile disk: flipped bits, a full disk, stale temp files."""

import errno
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from tests.fault_scripts import disks
from unison.checkpoint.errors import CheckpointError, DiskFullError
from unison.checkpoint.format import (
    atomic_save,
    free_bytes,
    human_bytes,
    remove_stale_temps,
    safe_load,
    storage_bytes,
)


def _state(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(n, generator=g), "b": torch.ones(3)}
    return {"unison_format": 1, "kind": "checkpoint", "model": model}


def _entry_span(path, suffix):
    """(offset, size) of the data of the zip entry whose name ends with `suffix` (read with zipfile)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:  # the local header: 30 bytes + name + extra, then the data
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size, info.filename


def test_flipped_bits_in_a_tensor_are_refused_naming_the_entry(tmp_path):
    path = atomic_save(_state(), tmp_path / "c.pth")
    start, size, name = _entry_span(path, "data/0")
    raw = bytearray(path.read_bytes())
    middle = start + size // 2
    for i in range(16):  # 16 flipped bits in the middle of the tensor's data, as in the report
        raw[middle + i // 8] ^= 1 << (i % 8)
    path.write_bytes(bytes(raw))
    # Without a check torch loads it: the damage is silent (what the issue found).
    loaded = torch.load(path, weights_only=True)
    assert not torch.equal(loaded["model"]["w"], _state()["model"]["w"])
    with pytest.raises(CheckpointError, match=f"damaged.*{name}.*CRC"):
        safe_load(path)


def test_an_intact_checkpoint_loads_bit_identical(tmp_path):
    path = atomic_save(_state(), tmp_path / "c.pth")
    loaded = safe_load(path)
    assert torch.equal(loaded["model"]["w"], _state()["model"]["w"])


def test_a_flipped_bit_in_the_pickle_is_refused(tmp_path):
    path = atomic_save(_state(), tmp_path / "c.pth")
    start, size, name = _entry_span(path, "data.pkl")
    raw = bytearray(path.read_bytes())
    raw[start + size - 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"damaged.*{name}"):
        safe_load(path)


@pytest.fixture
def small_disk(tmp_path):
    with disks.small_disk(tmp_path / "disk") as mount:
        yield mount


def _many(n, numel, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "unison_format": 1,
        "kind": "checkpoint",
        "model": {f"t{i}": torch.randn(numel, generator=g) for i in range(n)},
    }


@pytest.mark.parametrize("when", ["before writing", "while writing"])
def test_a_full_disk_is_reported_as_such_and_the_previous_checkpoint_survives(small_disk, when):
    path = small_disk / "checkpoint.pth"
    first = _many(50, 256, seed=0)  # 50 KB of tensors
    atomic_save(first, path)
    second = _many(50, 256, seed=1)
    # Before: less room than the tensors need. While: room for the tensors, not for the zip around them.
    disks.fill(small_disk, 20_000 if when == "before writing" else storage_bytes(second) + 8192)
    with pytest.raises(DiskFullError) as info:
        atomic_save(second, path)
    message = str(info.value)
    assert (
        "ENOSPC" in message
        and str(path) in message
        and f"{human_bytes(free_bytes(small_disk))} free" in message
    )
    if when == "before writing":
        assert f"needs about {human_bytes(storage_bytes(second))}" in message
    else:  # torch's own error here was "unexpected pos ...": the disk's is kept
        assert "were written" in message
    # the OS's own words are in the headline (the launcher's summary shows only the last exception)
    assert f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}" in message, message
    assert list(small_disk.glob(".checkpoint.pth.*.tmp")) == []  # nothing half-written is left
    loaded = safe_load(path)  # the previous checkpoint is whole
    assert all(torch.equal(loaded["model"][k], first["model"][k]) for k in first["model"])


_WRITER = """
import sys, torch
from unison.checkpoint.format import atomic_save
state = {"unison_format": 1, "kind": "checkpoint", "model": {"w": torch.randn(8_000_000)}}
print("ready", flush=True)
while True:
    atomic_save(state, sys.argv[1])
"""

_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1].format(pid=os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
time.sleep(60)
"""


def _size(file):
    try:
        return file.stat().st_size
    except FileNotFoundError:  # renamed meanwhile
        return 0


def _killed_mid_write(path):
    """Start a writer saving `path` over and over, SIGKILL it while a temp file exists."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while not any(_size(t) > 1_000_000 for t in path.parent.glob(f".{path.name}.*.tmp")):
        assert time.monotonic() < deadline, "the writer never got into a save"
        time.sleep(0.002)
    writer.kill()
    writer.wait(30)
    return list(path.parent.glob(f".{path.name}.*.tmp"))


@pytest.mark.procs
def test_a_kill_during_a_save_leaves_a_temp_file_that_the_next_save_removes(tmp_path):
    path = tmp_path / "checkpoint.pth"
    stale = _killed_mid_write(path)
    assert len(stale) == 1 and stale[0].stat().st_size > 0
    atomic_save(_state(), path)
    assert list(tmp_path.glob(".*.tmp")) == []
    assert torch.equal(safe_load(path)["model"]["w"], _state()["model"]["w"])


@pytest.mark.procs
def test_a_live_writers_temp_file_is_never_removed(tmp_path):
    path = tmp_path / "checkpoint.pth"
    pattern = str(tmp_path / ".checkpoint.pth.{pid}.0123456789ab.tmp")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, pattern], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        live = tmp_path / f".checkpoint.pth.{holder.pid}.0123456789ab.tmp"
        other = tmp_path / ".other.pth.1.0123456789ab.tmp"  # another checkpoint's: not ours to judge
        other.write_bytes(b"x")
        assert remove_stale_temps(path) == []
        atomic_save(_state(), path)
        assert live.exists() and other.exists()
    finally:
        holder.kill()
        holder.wait(30)
    assert remove_stale_temps(path) == [live]  # its writer is gone now


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


@pytest.mark.parametrize(
    "payload,refused",
    [
        (_RunsCode(), "posix.system"),
        (torch.nn.Linear(2, 2), "torch.nn.modules.linear.Linear"),
        (print, "print"),
    ],
)
def test_a_pickled_object_is_refused_naming_the_global_without_torchs_advice(tmp_path, payload, refused):
    """torch's weights-only error advises re-running with weights_only=False (running the file's code):
    the refusal names the global it refused and never repeats that advice."""
    path = tmp_path / "checkpoint.pth"
    torch.save({"unison_format": 1, "kind": "checkpoint", "model": payload}, path)
    with pytest.raises(CheckpointError) as info:
        safe_load(path)
    message = str(info.value)
    assert f"refused the global {refused} " in message, message
    for advice in ("weights_only", "Re-run", "trusted source", "add_safe_globals", "allowlist"):
        assert advice not in message, message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained advice either

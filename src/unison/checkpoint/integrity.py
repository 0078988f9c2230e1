"""Integrity: no checkpoint loads with altered bytes.

Plain files (`torch.save`'s zip archives) carry a CRC32 per entry that torch writes but never
checks: `verify_integrity` checks them all. A sharded checkpoint folder's files are listed in
its manifest with their sizes and CRC32s (`file_checksum`), written last by `save_sharded`;
`check_files` checks them, each rank a balanced share of the bytes (`shares`).

    verify_integrity("models/checkpoint.pth")          # raises CheckpointError naming the entry
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

from unison.checkpoint.errors import CheckpointError

#: How every file but META_FILE is checked (zlib's CRC32: as fast as SHA-256 here, and what torch's
#: zip entries use; see benchmarks/sharded_integrity.py).
CHECKSUM = "crc32"
_CHUNK = 1 << 22


def file_checksum(path: str | os.PathLike[str], chunk: int = _CHUNK) -> str:
    """The CRC32 of a file's bytes as 8 hex digits, read in chunks (zlib releases the GIL).

    >>> _ = Path("shard.distcp").write_bytes(b"unison")
    >>> file_checksum("shard.distcp")
    '94d9a14a'
    """
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def verify_integrity(path: str | os.PathLike[str]) -> None:
    """Check every entry of a checkpoint's zip archive against the CRC32 written with it.

    torch writes a CRC32 for each entry (the pickle and each tensor's bytes) but does not
    check it on load: a flipped bit would load as a silently changed weight. This reads the
    whole file once (zipfile's `testzip`: about 0.1 s per 100 MB, see benchmarks/RESULTS.md) and
    raises `CheckpointError` naming the first damaged entry.

        verify_integrity("models/checkpoint.pth")
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # the first entry whose CRC32 fails, or that is cut short
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise CheckpointError(f"{path} is damaged or truncated ({exc})") from None
    if damaged is not None:
        raise CheckpointError(
            f"{path} is damaged: entry {damaged} fails its integrity check (CRC32 mismatch or cut short); "
            "refusing to load altered bytes"
        )


def check_files(path: Path, record: dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """Every file's size; the CRC32 of this rank's share of them (all of them on one process)."""
    sizes: dict[str, int] = record["files"]
    checksums: dict[str, str] = record.get("checksums", {})
    for name, size in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path} is torn: {name} is missing (it should have {size} bytes), refused")
        if file.stat().st_size != size:
            found = file.stat().st_size
            raise CheckpointError(f"{path} is torn: {name} should have {size} bytes, found {found}, refused")
    for name in shares(sizes, world)[rank]:
        if name in checksums and file_checksum(path / name) != checksums[name]:
            raise CheckpointError(
                f"{path} is damaged: {name} fails its checksum "
                "(CRC32 mismatch: its bytes changed since the save), refused"
            )


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files each rank hashes: the largest first, each to the rank with the fewest bytes so far."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (loads[i], i))
        shares[r].append(name)
        loads[r] += sizes[name]
    return shares

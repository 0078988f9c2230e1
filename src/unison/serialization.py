"""Checkpoint files: written atomically, read with `weights_only=True`, checked before use."""

from __future__ import annotations

import os
import pickle
import re
import secrets
import zipfile
from pathlib import Path
from typing import Any

import torch

FORMAT_KEY = "unison_format"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file that is missing, damaged, foreign, or does not fit the model."""


def atomic_save(obj: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `obj` to `path` so a reader never sees a torn file.

    The bytes go to a temporary file in the same folder, are flushed to disk, and the
    file is renamed over `path` only once complete: a crash at any point leaves the
    previous file intact.

    >>> atomic_save({"unison_format": 1, "model": model.state_dict()}, "models/m.pth")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its files are private (0600) and the rename would keep that mode.
    # O_EXCL with mode 0666 gives the permissions of a plain open() under the user's umask.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def safe_load(
    path: str | os.PathLike[str], map_location: Any = None, kind: str | None = None
) -> dict[str, Any]:
    """Read a unison checkpoint with `weights_only=True` (no arbitrary unpickling).

    Raises `CheckpointError` with a one-line reason for a missing, truncated, foreign
    or wrong-kind file; nothing is returned half-read.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive whose directory is at the very end: any cut loses it.
        # (Without this check a file cut to a few bytes is read as a legacy pickle and
        # misreported as holding unsafe objects.)
        raise CheckpointError(
            f"{path} is damaged or truncated (not a complete zip archive, {path.stat().st_size} bytes)"
        )
    verify_integrity(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects that are not plain tensors or values, refused: {_unpickling_reason(exc)}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is damaged or truncated ({reason})") from None
    if not isinstance(obj, dict) or FORMAT_KEY not in obj:
        raise CheckpointError(f"{path} is not a unison checkpoint (no '{FORMAT_KEY}' entry)")
    if obj[FORMAT_KEY] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format {obj[FORMAT_KEY]}, newer than this unison reads ({FORMAT_VERSION})"
        )
    if kind is not None and obj.get("kind") != kind:
        raise CheckpointError(f"{path} is a '{obj.get('kind')}' file, expected '{kind}'")
    return obj


def verify_integrity(path: str | os.PathLike[str], chunk: int = 1 << 20) -> None:
    """Check every entry of a checkpoint's zip archive against the CRC32 written with it.

    torch writes a CRC32 for each entry (the pickle and each tensor's bytes) but does not
    check it on load: a flipped bit would load as a silently changed weight. This reads the
    whole file once (about 0.1 s per 100 MB, see benchmarks/RESULTS.md) and raises
    `CheckpointError` naming the first damaged entry.

    >>> verify_integrity("models/checkpoint.pth")
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                try:
                    with archive.open(info) as entry:  # zipfile checks the CRC32 when an entry ends
                        while entry.read(chunk):
                            pass
                except zipfile.BadZipFile as exc:
                    raise CheckpointError(
                        f"{path} is damaged: entry {info.filename} fails its integrity check ({exc}: "
                        "CRC32 mismatch or cut short); refusing to load altered bytes"
                    ) from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise CheckpointError(f"{path} is damaged or truncated ({exc})") from None


def _unpickling_reason(exc: Exception) -> str:
    """The line of torch's weights-only error that names what was refused, without terminal codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    if found:
        return found.group(1).split(" Please use ")[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check_state_fits(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path | str) -> None:
    """Raise `CheckpointError` unless `state` has exactly `model`'s keys and shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit this model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    for key, value in own.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise CheckpointError(
                f"{source} does not fit this model: {key} has shape {tuple(state[key].shape)}, "
                f"the model has {tuple(value.shape)}"
            )

"""Checkpoint files: written atomically, read with `weights_only=True`, checked before use."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import re
import secrets
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.errors import CheckpointError, DiskFullError
from unison.checkpoint.integrity import verify_integrity

FORMAT_KEY = "unison_format"
FORMAT_VERSION = 1


def storage_bytes(obj: Any) -> int:
    """Bytes of tensor data in `obj` (nested dicts, lists, tuples), each storage counted once."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
                key, size = id(item), item.element_size() * item.nelement()
            if key not in seen or size == 0:
                seen.add(key)
                total += size
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def free_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes this user may still write in `folder`'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _disk_full(
    path: Path, needed: int, written: int | None = None, cause: OSError | None = None
) -> DiskFullError:
    """The one-line report of a full disk: the OS's error, the file, the space needed and free.

    The OS's own words lead (`OSError: [Errno 28] No space left on device`): a summary that
    shows only the last exception of a chain must still show them.
    """
    free = free_bytes(path.parent)
    done = f" after {human_bytes(written)} were written" if written is not None else ""
    if cause is None:  # checked before writing: the error the write would have met
        os_error = f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}, checked before writing"
    else:
        assert cause.errno is not None  # the caller passes an ENOSPC / EDQUOT error (_enospc)
        os_error = (
            f"{type(cause).__name__}: [Errno {cause.errno}] {cause.strerror or os.strerror(cause.errno)}"
        )
    return DiskFullError(
        f"disk full (ENOSPC; {os_error}) writing {path}: it needs about {human_bytes(needed)}, "
        f"{human_bytes(free)} free in {path.parent}{done}; any previous checkpoint there is kept whole. "
        "Free space or choose another folder: a restart would hit the same wall"
    )


def human_bytes(n: int) -> str:
    """`1536` -> '1.5 kB' (powers of 1000, as `df -H`)."""
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} bytes"


class _CountingWriter:
    """The temp file as torch writes it: counts bytes and keeps the OS error (ENOSPC) that torch
    would turn into an unrelated 'unexpected pos' message."""

    def __init__(self, raw: Any):
        self.raw, self.written = raw, 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.raw.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.written += n or 0
        return n

    def flush(self) -> None:
        self.raw.flush()


_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove temp files that dead writers of `path` left behind (a kill during a save).

    A file counts as stale only if no process holds its lock (a writer holds one from
    creation to rename) and the writer's pid, in its name, is no longer running: another
    live writer's file is never touched. Returns the files removed.

    >>> remove_stale_temps("models/checkpoint.pth")
    []
    """
    path = Path(path)
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        found = _TMP.match(tmp.name)
        if found is None or found.group("name") != path.name or _alive(int(found.group("pid"))):
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live writer: leave it
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where `keep_previous` keeps the checkpoint a save replaced: `checkpoint.pth` -> `checkpoint.prev.pth`
    (and `checkpoint.dcp` -> `checkpoint.prev.dcp`)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


#: Checkpoints resumed from their previous copy in this process: the next save with `keep_previous`
#: replaces the refused newest and leaves that good previous copy where it is (once).
_RESUMED_FROM_PREVIOUS: set[Path] = set()


def note_resumed_from_previous(path: str | os.PathLike[str]) -> None:
    """Record that `path` was refused and its previous copy used (see `rotate_previous`)."""
    _RESUMED_FROM_PREVIOUS.add(Path(path).absolute())


def rotate_previous(path: str | os.PathLike[str], keep_previous: bool) -> bool:
    """Whether a save of `path` with `keep_previous` should keep the checkpoint it replaces: not
    when that one was refused and this process resumed from the previous copy instead."""
    key = Path(path).absolute()
    if key in _RESUMED_FROM_PREVIOUS:
        _RESUMED_FROM_PREVIOUS.discard(key)
        return False
    return keep_previous


def _temp_path(path: Path) -> Path:
    """A writer's temp file for `path`, beside it: named by its pid (see `remove_stale_temps`)."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def fsync_dir(folder: Path) -> None:
    """Make the renames and new names in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_as_previous(path: Path) -> None:
    """Make `previous_path(path)` hold `path`'s current bytes, atomically (`path` itself stays)."""
    previous = previous_path(path)
    tmp = _temp_path(previous)
    try:
        os.link(path, tmp)  # the same bytes, no copy
    except OSError:  # a file system without hard links
        shutil.copyfile(path, tmp)
    os.replace(tmp, previous)


def atomic_save(obj: dict[str, Any], path: str | os.PathLike[str], keep_previous: bool = False) -> Path:
    """Write `obj` to `path` so a reader never sees a torn file.

    The bytes go to a temporary file in the same folder, are flushed to disk, and the
    file is renamed over `path` only once complete: a crash at any point leaves the
    previous file intact. A disk too full for it raises `DiskFullError` (before writing
    when the tensors alone do not fit); temp files left by killed writers are removed.
    With `keep_previous`, the file replaced is kept as `previous_path(path)`.

    >>> print(atomic_save({"unison_format": 1, "model": torch.nn.Linear(2, 1).state_dict()}, "models/m.pth"))
    models/m.pth
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    needed = storage_bytes(obj)
    if needed > free_bytes(path.parent):
        raise _disk_full(path, needed)
    # Not tempfile.mkstemp: its files are private (0600) and the rename would keep that mode.
    # O_EXCL with mode 0666 gives the permissions of a plain open() under the user's umask.
    tmp = _temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)  # ours until renamed: remove_stale_temps never takes it
    writer = None
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _CountingWriter(f)
            torch.save(obj, writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        if rotate_previous(path, keep_previous) and path.is_file():
            _keep_as_previous(path)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = _enospc(exc, writer)
        if cause is not None:
            raise _disk_full(
                path, max(needed, writer.written if writer else 0), writer.written if writer else None, cause
            ) from exc
        raise
    fsync_dir(path.parent)  # make the rename itself durable
    return path


def _enospc(exc: BaseException, writer: _CountingWriter | None) -> OSError | None:
    """The OS's no-space error behind `exc` (torch may raise its own error over it), or None."""
    for err in (exc, exc.__cause__, exc.__context__, writer.error if writer else None):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
    return None


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
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        # The weights-only loader's refusal: an UnpicklingError, or wrapped in another error.
        if isinstance(exc, pickle.UnpicklingError) or "weights_only" in str(exc):
            raise CheckpointError(
                f"{path} holds objects that are not plain tensors or values: {_refusal(exc)}"
            ) from None
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


#: torch's weights-only errors advise loading with weights_only=False or allow-listing the global:
#: both run the file's code, so no line carrying that advice is ever repeated.
_ADVICE = (
    "weights_only",
    "re-run",
    "trusted source",
    "add_safe_globals",
    "safe_globals",
    "allowlist",
    "documentation",
)


def _refusal(exc: Exception) -> str:
    """What torch's weights-only loader refused, named, without its advice or terminal codes.

    >>> _refusal(pickle.UnpicklingError("... Trying to load unsupported GLOBAL posix.system whose ..."))[:33]
    'refused the global posix.system ('
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"GLOBAL\s+([\w.]+)", text)
    if found:
        return (
            f"refused the global {found.group(1)} (loading it would run code from the file; a checkpoint "
            "holds tensors and plain values only)"
        )
    lines = [line.strip() for line in re.split(r"\n|(?<=\.) ", text) if line.strip()]
    plain = [line for line in lines if not any(word in line.lower() for word in _ADVICE)]
    return f"refused ({plain[0]})" if plain else "refused by torch's weights-only loader"


def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a `state_dict`, by key."""
    return {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}


def check_fits(
    source: Path | str, own: Mapping[str, tuple[int, ...]], stored: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise `CheckpointError` unless the tensors `stored` in `source` have exactly the model's keys and
    shapes (`own`), both as `shapes` gives them.

    >>> check_fits("m.pth", {"weight": (1, 2)}, {"weight": (2, 2)})
    Traceback (most recent call last):
    unison.checkpoint.errors.CheckpointError: m.pth does not fit this model: weight has shape (2, 2), ...
    """
    missing, unexpected = sorted(set(own) - set(stored)), sorted(set(stored) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit this model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    for key, shape in own.items():
        if stored[key] != shape:
            raise CheckpointError(
                f"{source} does not fit this model: {key} has shape {stored[key]}, the model has {shape}"
            )

"""Checkpoints of sharded models: `torch.distributed.checkpoint` (DCP), one writer per shard, atomic.

A sharded checkpoint is a folder (`name.dcp`) holding DCP's shard files (each rank writes
its own: no full gather on rank 0), DCP's `.metadata`, and `unison.pth`: the run's other
state (position, RNG, recorder, callbacks) plus the manifest, the size and CRC32 of every
other file, written last.

- Atomic: everything is written into a hidden temporary folder, which is renamed over
  the last checkpoint only once complete; a save killed at any point leaves the last good
  checkpoint in place (or, killed between the two renames, beside it, and found there).
  `keep_previous=True` keeps the checkpoint it replaces as `name.prev.dcp`.
- Checked before anything is read: `unison.pth` by the CRC32s of its zip entries, every
  other file by its size and its CRC32 in the manifest (each rank hashes the files it
  wrote; on load each rank checks a share of the bytes, and one collective makes every rank
  refuse with the same line). A folder without `unison.pth`, with a file missing, cut or
  altered, or whose tensors do not fit the model, is refused with a one-line reason naming
  the file. A checkpoint of an older unison, without checksums, loads with a warning.
- Resharded: DCP reads whatever slice each rank needs, so a checkpoint written on W
  processes loads on any number, sharded or not (one process gets plain full tensors).

    save_sharded(Path("models/run.dcp"), learn.model, learn.opt, {"epoch": 3}, learn.collective)
    export_state_dict(Path("models/run.dcp"), Path("models/run_weights.pth"))   # for inference
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from unison.checkpoint.errors import CheckpointError
from unison.checkpoint.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    atomic_save,
    check_fits,
    fsync_dir,
    previous_path,
    rotate_previous,
    safe_load,
    shapes,
)
from unison.checkpoint.integrity import CHECKSUM, check_files, file_checksum
from unison.distributed.collective import Collective

META_FILE = "unison.pth"


def sharded_path(file: str | os.PathLike[str]) -> Path:
    """Where the sharded form of checkpoint `file` lives: the same name with `.dcp`."""
    return Path(file).with_suffix(".dcp")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no group: here that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What DCP saves or loads in place: the model's and optimizers' state (none: empty), shards
    where sharded. A fresh optimizer's state is allocated."""
    model_state, opt_state = get_state_dict(model, optimizers)
    return {"model": model_state, "optim": opt_state}


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to hash them)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # already done: FileSystemWriter writes in place
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


def save_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    collective: Collective,
    keep_previous: bool = False,
) -> Path:
    """Write `model` and `opt` (sharded or not) and `meta` to the folder `directory`, atomically.

    A collective: every rank calls it. Each rank writes its own shards and hashes them;
    rank 0 writes `meta` and the manifest of every file's size and CRC32, last. With
    `keep_previous`, the checkpoint replaced is kept as `previous_path(directory)`.

        save_sharded("models/checkpoint.dcp", learn.model, learn.opt, {"epoch": 1}, learn.collective)
    """
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    token = collective.broadcast_object(secrets.token_hex(6))
    tmp = final.parent / f".{final.name}.tmp-{token}"
    state = _state(model, [opt] if opt is not None else [])
    writer = _RecordingWriter(tmp)
    with _quiet():  # returns once every rank's shards are written
        dcp.save(state, storage_writer=writer, no_dist=not collective.active)
    # Each rank hashes what it wrote (its files are still in its page cache), rank 0 the rest (.metadata).
    try:
        mine: dict[str, str] | str = {name: file_checksum(tmp / name) for name in writer.written}
    except OSError as exc:  # reported through the gather, so that no rank waits for this one
        mine = f"rank {collective.rank} could not read back what it wrote to {tmp}: {exc}"
    parts = collective.gather_objects(mine)
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        raise CheckpointError(failed[0])
    checksums = {k: v for part in parts for k, v in part.items()}
    if collective.is_main:
        files = sorted(tmp.iterdir())
        checksums.update({f.name: file_checksum(f) for f in files if f.name not in checksums})
        record = {
            FORMAT_KEY: FORMAT_VERSION,
            "kind": "sharded",
            "files": {f.name: f.stat().st_size for f in files},
            "checksum": CHECKSUM,
            "checksums": {f.name: checksums[f.name] for f in files},
            "state": meta,
        }
        # Then every file and name in the folder is on disk: DCP's writer syncs each file it writes
        # (the shards, `.metadata`), atomic_save its own file and then the folder.
        atomic_save(record, tmp / META_FILE)
        old = final.parent / f".{final.name}.old-{token}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if rotate_previous(final, keep_previous) and old.exists():
            previous = previous_path(final)
            trash = final.parent / f".{final.name}.trash-{token}"
            if previous.exists():
                os.replace(previous, trash)
            os.replace(old, previous)
            fsync_dir(final.parent)
        for stale in final.parent.glob(f".{final.name}.*-*"):  # this save's and those left by killed saves
            shutil.rmtree(stale, ignore_errors=True)
    collective.barrier()  # nobody reads the checkpoint before it is in place
    return final


def find_sharded(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint folder to read for `directory`: itself, or the previous one a save killed
    between its two renames left aside; None when there is neither."""
    final = Path(directory)
    if final.exists():
        return final
    aside = sorted(final.parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)
    return aside[-1] if aside else None


def read_meta(
    directory: str | os.PathLike[str],
    model: nn.Module | None = None,
    collective: Collective | None = None,
) -> dict[str, Any]:
    """Check that the folder is a whole sharded checkpoint (and fits `model`); return its meta state.

    Every file is checked against the manifest (size and CRC32) before any of it is read.
    With a `collective` of several ranks (a collective then: every rank calls it), each rank
    hashes a share of the bytes and one gather makes every rank raise the same error.
    Raises `CheckpointError` with a one-line reason naming the file.

        read_meta("models/checkpoint.dcp", learn.model, learn.collective)["epoch"]
    """
    path = Path(directory)
    collective = collective if collective is not None else Collective()  # (one process: no collectives)
    record: dict[str, Any] | None = None
    error = None
    try:
        record = _read_record(path)
        check_files(path, record, collective.rank, collective.world_size)
    except CheckpointError as exc:
        error = str(exc)
    error = next((e for e in collective.gather_objects(error) if e is not None), None)
    if error is not None:
        raise CheckpointError(error)
    assert record is not None
    if "checksums" not in record and collective.is_main:
        warnings.warn(
            f"{path} was written by an older unison and has no checksums: its files are checked for "
            "size only, so flipped bits would load unseen. Saving it again adds them",
            stacklevel=2,
        )
    if model is not None:
        stored = {key: tuple(item.size) for key, item in _stored_model_tensors(path).items()}
        check_fits(path, shapes(get_model_state_dict(model)), stored)
    return record["state"]


def _read_record(path: Path) -> dict[str, Any]:
    """The folder's `unison.pth` (its own zip entries CRC-checked by `safe_load`)."""
    if not path.is_dir():
        raise CheckpointError(f"no sharded checkpoint at {path}")
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"{path} is incomplete (no {META_FILE}: its save was interrupted), refused")
    record = safe_load(path / META_FILE, kind="sharded")
    if record.get("checksum", CHECKSUM) != CHECKSUM:
        raise CheckpointError(f"{path} uses checksum {record['checksum']!r}, unknown to this unison, refused")
    return record


def _stored_model_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    """What DCP's `.metadata` says of each model tensor in the folder (its full size and dtype), by key."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {
        key[len("model.") :]: item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }


def load_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    collective: Collective,
) -> None:
    """Read model (and optimizer, when given and saved) state from a sharded checkpoint into
    `model`, sharded or not, on any number of processes: each rank reads the slices it holds.
    Check with `read_meta` first. A collective: every rank calls it.

        load_sharded("models/checkpoint.dcp", learn.model, learn.opt, learn.collective)
    """
    path = Path(directory)
    saved_opt = any(
        k.startswith("optim.") for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    )
    optimizers = [opt] if opt is not None and saved_opt else []
    state = _state(model, optimizers)
    with _quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not collective.active)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full_into_sharded(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    model_state: dict[str, Any],
    opt_state: dict[str, Any] | None,
) -> None:
    """Load a plain checkpoint's full `state_dict`s (a one-process or DDP run's) into a sharded
    model and its optimizer; each rank keeps its own slices.

        load_full_into_sharded(learn.model, learn.opt, state["model"], state["opt"])
    """
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    if opt is None or opt_state is None:
        return
    # torch numbers an optimizer's parameters group by group, in the order it was given them:
    # the same optimizer built over the same model numbers them the same way.
    name_of = {id(p): name for name, p in model.named_parameters()}
    saved_groups, groups = opt_state["param_groups"], opt.param_groups
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise CheckpointError("the checkpoint's optimizer has other parameter groups than this learner's")
    names = {
        i: name_of[id(p)]
        for saved, group in zip(saved_groups, groups, strict=True)
        for i, p in zip(saved["params"], group["params"], strict=True)
    }
    if not any(torch.is_tensor(v) for s in opt_state["state"].values() for v in s.values()):
        # No tensors to shard (plain SGD): the hyper-parameters are all there is.
        for group, saved in zip(groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    by_name: dict[str, Any] = {
        "state": {names[i]: s for i, s in opt_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved_groups],
    }
    set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=True))


def export_state_dict(checkpoint: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
    """Write the model weights of a checkpoint as one plain `state_dict` file, for inference.

    `checkpoint` is a sharded folder (`.dcp`), a unison `.pth` file (`Learner.save`, `Checkpoint`),
    or a `.pth` name whose sharded twin `.dcp` exists; of two, the newer is read. Runs on one
    process with no process group, and reads only the model's tensors.

        export_state_dict("models/checkpoint.pth", "model.pth")
        model.load_state_dict(torch.load("model.pth", weights_only=True))
    """
    path = Path(checkpoint)
    folder = path if path.suffix == ".dcp" else find_sharded(sharded_path(path))
    candidates = [
        p for p in (folder, path if path.suffix != ".dcp" else None) if p is not None and p.exists()
    ]
    if not candidates:
        raise CheckpointError(f"no checkpoint at {path} (nor a sharded one at {sharded_path(path)})")
    newest = max(candidates, key=lambda p: p.stat().st_mtime)
    if newest.is_file():
        return atomic_save(safe_load(newest, map_location="cpu")["model"], file)
    read_meta(newest)
    weights = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in _stored_model_tensors(newest).items()
    }
    with _quiet():
        dcp.load({"model": weights}, checkpoint_id=newest, no_dist=True)
    return atomic_save(weights, file)

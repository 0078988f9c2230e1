"""One save/load pair for both checkpoint formats, the format named by the strategy that trains the
model: "file" (rank 0 writes one atomic file, `format.py`) or "dcp" (every rank writes its shards
of the model and optimizer into a folder, `sharded.py`). Only the weights differ: the rest of the
state (plain values and tensors) travels inside the file, or as the folder's `unison.pth`.

- `save` writes weights and state as the format says (a collective under "dcp").
- `find` verifies what is on disk (a DCP folder when the model is sharded or there is no file, else
  the file), falls back to the previous checkpoint where kept, and checks that it fits the model:
  nothing has changed yet.
- `load_weights` then puts model and optimizer state in place, from either format into either
  model (a DCP folder into a plain model, a plain file into a sharded one).

    found = find(file, "file", Weights(model, model, opt), collective)
    if found is not None:
        load_weights(found, Weights(model, model, opt), "file", collective)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unison.checkpoint.errors import CheckpointError
from unison.checkpoint.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    atomic_save,
    check_fits,
    note_resumed_from_previous,
    previous_path,
    remove_stale_temps,
    safe_load,
    shapes,
)
from unison.checkpoint.sharded import (
    find_sharded,
    load_full_into_sharded,
    load_sharded,
    read_meta,
    save_sharded,
    sharded_path,
)
from unison.distributed.collective import Collective


@dataclass(frozen=True)
class Weights:
    """The model as it trains (sharded under FSDP2), the same model inside its wrappers (`raw`:
    a file holds its `state_dict`'s keys), and its optimizer."""

    model: nn.Module
    raw: nn.Module
    opt: torch.optim.Optimizer | None


@dataclass(frozen=True)
class Found:
    """A verified checkpoint: the file or folder read (the previous one where the newest was
    refused), whether it is a DCP folder, and its state (a file's model and optimizer included)."""

    source: Path
    sharded: bool
    state: dict[str, Any]

    @property
    def holds_opt(self) -> bool:
        return self.state.get("with_opt", True) if self.sharded else "opt" in self.state


def save(
    file: Path,
    fmt: str,
    weights: Weights,
    state: dict[str, Any],
    collective: Collective,
    keep_previous: bool = False,
    kind: str = "checkpoint",
) -> Path:
    """Write `weights` (the optimizer where given) and `state` as `fmt` says: `file` by rank 0, or
    the folder `file.dcp` by every rank. Returns what was written."""
    if fmt == "dcp":
        return save_sharded(sharded_path(file), weights.model, weights.opt, state, collective, keep_previous)
    if collective.is_main:
        record = {FORMAT_KEY: FORMAT_VERSION, "kind": kind, **state, "model": weights.raw.state_dict()}
        if weights.opt is not None:
            record["opt"] = weights.opt.state_dict()
        atomic_save(record, file, keep_previous)
    return file


def find(
    file: Path,
    fmt: str,
    weights: Weights,
    collective: Collective,
    keep_previous: bool = False,
    kind: str = "checkpoint",
    map_location: Any = "cpu",
    strict: bool = True,
) -> Found | None:
    """The checkpoint saved as `file` (or its folder `file.dcp`), verified on every rank and fitting
    `weights`' model (a file's keys and shapes only with `strict`); None when there is neither. A
    collective under "dcp", or for a folder."""
    if collective.is_main:  # the writer's rank: temp files of a save a kill cut short
        remove_stale_temps(file)
    folder = find_sharded(sharded_path(file)) if fmt == "dcp" or not file.exists() else None
    if folder is not None:

        def read(path: Path) -> dict[str, Any]:
            return read_meta(path, weights.model, collective)

        source, state = _newest_or_previous(read, folder, sharded_path(file), keep_previous, collective)
        return Found(source, True, state)
    if not file.exists():
        return None

    def read_file(path: Path) -> dict[str, Any]:
        state = safe_load(path, map_location=map_location, kind=kind)
        if strict or fmt == "dcp":
            check_fits(path, shapes(weights.raw.state_dict()), shapes(state["model"]))
        return state

    source, state = _newest_or_previous(read_file, file, file, keep_previous, collective)
    return Found(source, False, state)


def load_weights(
    found: Found, weights: Weights, fmt: str, collective: Collective, strict: bool = True
) -> None:
    """Put `found`'s model (and, where `weights` has one, optimizer) state in place; a collective
    for a folder or a sharded model. `strict` as `load_state_dict`'s, for a file into a plain model."""
    opt = weights.opt if found.holds_opt else None
    if found.sharded:
        load_sharded(found.source, weights.model, opt, collective)
    elif fmt == "dcp":
        load_full_into_sharded(weights.model, opt, found.state["model"], found.state.get("opt"))
    else:
        weights.raw.load_state_dict(found.state["model"], strict=strict)
        if opt is not None:
            opt.load_state_dict(found.state["opt"])


def _newest_or_previous(
    read: Callable[[Path], dict[str, Any]],
    newest: Path,
    saved_as: Path,
    keep_previous: bool,
    collective: Collective,
) -> tuple[Path, dict[str, Any]]:
    """`read(newest)`; with `keep_previous`, a refused `newest` falls back to the previous checkpoint
    saved as `saved_as`, with a warning on rank 0 (every rank takes the same branch: `read` agrees)."""
    try:
        return newest, read(newest)
    except CheckpointError as exc:
        if not keep_previous:
            raise
        refused = str(exc)
    previous = previous_path(saved_as)
    try:
        state = read(previous)
    except CheckpointError as exc:
        if not os.path.exists(previous):
            raise CheckpointError(f"{refused} (and there is no previous checkpoint {previous})") from None
        raise CheckpointError(f"{refused}; the previous checkpoint is refused too: {exc}") from None
    if collective.is_main:
        warnings.warn(f"{refused}; resuming from the previous checkpoint {previous}", stacklevel=3)
    note_resumed_from_previous(saved_as)  # the next save replaces the refused one and keeps this
    return previous, state

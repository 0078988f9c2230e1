"""A learner's own files: `save` / `load` of its model (and optimizer), `fit(resume=True)`, and the
in-memory `snapshot` / `restore` that `lr_find` uses.

Both formats go through `store`'s one save/load pair: a plain model is written by rank 0 alone,
atomically, and read back weights-only and checked against the model; a sharded (FSDP2) model
writes a DCP folder, every rank its own shards.

    save(learn, "stage1")          # learn.save("stage1"): models/stage1.pth
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.checkpoint import store
from unison.checkpoint.errors import CheckpointError
from unison.checkpoint.store import Weights
from unison.distributed.env import rank_distrib

if TYPE_CHECKING:
    from unison.learner_view import EngineHost, LearnerView
    from unison.loop_state import StartPoint


def model_file(learn: LearnerView, name: str | Path) -> Path:
    """Where `save(name)` writes: `path/model_dir/name.pth` (a path with a suffix is used as is)."""
    name = Path(name)  # (an absolute path stays itself: pathlib's `/` keeps it)
    return learn.path / learn.model_dir / (name if name.suffix else f"{name}.pth")


def save(learn: LearnerView, name: str | Path, with_opt: bool = True) -> Path:
    """Write the model (and optimizer) state atomically, as the model's strategy names the format:
    rank 0 writes `name.pth`, or every rank its shards into `name.dcp`; every rank waits for it."""
    file, fmt = model_file(learn, name), learn.checkpoint_format
    weights = Weights(learn.model, learn.raw_model, learn.opt if with_opt else None)
    # Outside distrib_ctx the collective says rank 0 everywhere: the group or launcher decides.
    if fmt == "dcp" or rank_distrib() == 0:
        file = store.save(
            file, fmt, weights, {"with_opt": weights.opt is not None}, learn.collective, kind="model"
        )
    learn.collective.barrier()  # nobody reads the file before it is complete
    return file


def load(learn: LearnerView, name: str | Path, with_opt: bool = True, strict: bool = True) -> None:
    """Load what `save` wrote, in either format into either kind of model (a file mapped to this
    process's device); checked before anything changes (the keys and shapes only with `strict`)."""
    file, fmt = model_file(learn, name), learn.checkpoint_format
    on = learn.device if fmt == "file" else "cpu"  # (a sharded model takes its slices of full CPU tensors)
    weights = Weights(learn.model, learn.raw_model, None)
    found = store.find(file, fmt, weights, learn.collective, kind="model", map_location=on, strict=strict)
    if found is None:
        raise CheckpointError(f"no checkpoint file at {file}")
    if with_opt and found.holds_opt and learn.opt is None:
        learn.create_opt()
    weights = Weights(learn.model, learn.raw_model, learn.opt if with_opt else None)
    store.load_weights(found, weights, fmt, learn.collective, strict=strict)


def resume(learn: EngineHost) -> StartPoint | None:
    """`fit(resume=True)`: load the newest checkpoint the fit's `Checkpoint` wrote, if any, and
    return where the fit continues (None: there is none yet, the fit starts fresh)."""
    from unison.checkpoint.callback import Checkpoint

    ckpt = learn.get_cb(Checkpoint)
    if not isinstance(ckpt, Checkpoint):
        raise ValueError(
            "fit(resume=True) needs a Checkpoint callback (cbs=[Checkpoint()]) that says "
            "where checkpoints are"
        )
    return ckpt.restore_latest()


def snapshot(learn: LearnerView) -> dict[str, Any]:
    """Deep copies of the model and optimizer state, for `restore` (kept in memory)."""
    return {
        "model": copy.deepcopy(learn.raw_model.state_dict()),
        "opt": copy.deepcopy(learn.opt.state_dict()) if learn.opt is not None else None,
    }


def restore(learn: LearnerView, snap: dict[str, Any]) -> None:
    """Put back what `snapshot` took."""
    learn.raw_model.load_state_dict(snap["model"])
    if snap["opt"] is not None and learn.opt is not None:
        learn.opt.load_state_dict(snap["opt"])

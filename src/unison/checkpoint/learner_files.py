"""A learner's own files: `save` / `load` of its model (and optimizer), `fit(resume=True)`, and the
in-memory `snapshot` / `restore` that `lr_find` uses.

A plain model is written by rank 0 alone, atomically (`format.atomic_save`), and read back
weights-only and checked against the model; a sharded (FSDP2) model writes a DCP folder, every
rank its own shards (`sharded.save_learner`).

    save(learn, "stage1")          # learn.save("stage1"): models/stage1.pth
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.checkpoint.format import FORMAT_KEY, FORMAT_VERSION, atomic_save, check_state_fits, safe_load
from unison.checkpoint.sharded import load_learner, save_learner
from unison.distributed.env import rank_distrib

if TYPE_CHECKING:
    from unison.learner_view import EngineHost, LearnerView
    from unison.loop_state import StartPoint


def model_file(learn: LearnerView, name: str | Path) -> Path:
    """Where `save(name)` writes: `path/model_dir/name.pth` (a path with a suffix is used as is)."""
    name = Path(name)
    if name.suffix:
        return name if name.is_absolute() else learn.path / learn.model_dir / name
    return learn.path / learn.model_dir / f"{name}.pth"


def save(learn: LearnerView, name: str | Path, with_opt: bool = True) -> Path:
    """Write the model (and optimizer) state atomically; rank 0 writes, every rank waits for it."""
    file = model_file(learn, name)
    if learn.checkpoint_format == "dcp":  # every rank writes its own shards: name.dcp
        return save_learner(learn, file, with_opt)
    # Outside distrib_ctx the collective says rank 0 everywhere: the group or launcher decides.
    if learn.collective.is_main and rank_distrib() == 0:
        state: dict[str, Any] = {
            FORMAT_KEY: FORMAT_VERSION,
            "kind": "model",
            "model": learn.raw_model.state_dict(),
        }
        if with_opt and learn.opt is not None:
            state["opt"] = learn.opt.state_dict()
        atomic_save(state, file)
    learn.collective.barrier()  # nobody reads the file before it is complete
    return file


def load(learn: LearnerView, name: str | Path, with_opt: bool = True, strict: bool = True) -> None:
    """Load what `save` wrote, mapped to this process's device; checked before anything changes."""
    file = model_file(learn, name)
    if load_learner(learn, file, with_opt):  # a sharded save, or a sharded learner
        return
    state = safe_load(file, map_location=learn.device, kind="model")
    if strict:
        check_state_fits(learn.raw_model, state["model"], file)
    learn.raw_model.load_state_dict(state["model"], strict=strict)
    if with_opt and "opt" in state:
        if learn.opt is None:
            learn.create_opt()
        assert learn.opt is not None
        learn.opt.load_state_dict(state["opt"])


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

"""fastai's `lr_find` on W processes, as on one: the sweep takes as many steps of the global batch
(fastai counts its epochs from this rank's loader, W times longer than one process's), and every rank
starts again afterwards from the weights it had (fastai restores them from a temporary file that only
rank 0 writes, in a folder of its own)."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["end_sweep", "start_sweep"]


def start_sweep(learn: Any, raw_model: Any, train_shard: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Set the sweep's epochs from `train_shard` (this rank's share of the training loader); return
    what `end_sweep` restores: the model's and the optimizer's state."""
    finder = next(cb for cb in learn.cbs if type(cb).__name__ == "LRFinder")
    learn.n_epoch = finder.num_it // len(train_shard) + 1
    return copy.deepcopy(raw_model.state_dict()), copy.deepcopy(learn.opt.state_dict())


def end_sweep(learn: Any, raw_model: Any, before: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The model and optimizer as `start_sweep` found them, on every rank."""
    model, opt = before
    raw_model.load_state_dict(model)
    learn.opt.load_state_dict(opt)

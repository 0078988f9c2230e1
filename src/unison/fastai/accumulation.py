"""fastai's `GradientAccumulation(n_acc)` on W processes, on the engine's own accumulation.

fastai's callback counts the rows each process sees and steps once the count reaches `n_acc`, its
gradient the sum of the accumulated losses over `n_acc`. On W processes each rank sees 1/W of every
batch, so the callback alone would step every W x `n_acc` rows. Under the bridge it is paused and
this counts the global batch's rows instead: the micro-steps run under DDP's `no_sync`, the engine
divides the step's gradient by its global count, and the factor `count / n_acc` makes it fastai's
sum over `n_acc`. So W processes step where one fastai process steps, with its gradient.
"""

from __future__ import annotations

from typing import Any

from fastai.callback.core import CancelBatchException

__all__ = ["Accumulation", "find_accumulation", "refuse_unresumable"]


class Accumulation:
    """The global count of one fastai `GradientAccumulation`'s optimizer step in progress."""

    def __init__(self, n_acc: int) -> None:
        self.n_acc = n_acc
        self.count = 0  # rows of every rank since the last step (it runs on across epochs, as fastai's)
        self.step_now = True

    def before_batch(self, global_rows: int) -> bool:
        """Count this training batch's rows over every rank; whether it ends an optimizer step."""
        self.count += global_rows
        self.step_now = self.count >= self.n_acc
        return self.step_now

    def scale(self, model: Any) -> None:
        """The step's gradient (the engine's mean over `count` rows) as fastai's sum over `n_acc`."""
        factor = self.count / self.n_acc
        if factor != 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def before_step(self) -> None:
        if not self.step_now:
            raise CancelBatchException()  # keep the gradients, skip step and zero_grad (as fastai's)
        self.count = 0


def refuse_unresumable(learn: Any, train_shard: Any, world_size: int) -> None:
    """A checkpoint keeps no accumulated gradient: with checkpoints, fastai's `GradientAccumulation`
    resumes exactly only where every save falls on an optimizer step, so on W > 1 processes (mid-epoch
    saves come at steps) and with every epoch ending on one. Else one line, before the first step."""
    found = [cb for cb in learn.cbs if type(cb).__name__ == "GradientAccumulation"]
    if not found:
        return
    left, n_acc = 0, int(found[0].n_acc)
    for k in range(len(train_shard)):  # (one epoch, counted as `Accumulation` counts it)
        left += train_shard.global_rows(k)
        left = 0 if left >= n_acc else left
    if world_size == 1 or left:
        raise ValueError(
            "unison.fastai: fastai's GradientAccumulation with checkpoints would resume off the "
            "uninterrupted run (a checkpoint keeps no accumulated gradient; on "
            f"{world_size} process(es) an epoch ends {left} rows into a step, or one process saves "
            "mid-step): train on W > 1 processes with n_acc dividing an epoch's rows, or without "
            "checkpoint_every/resume"
        )


def find_accumulation(learn: Any) -> Accumulation | None:
    """A fastai `GradientAccumulation` among `learn`'s callbacks, paused for this fit (fastai sets
    `run` again after it), as an `Accumulation`; None when there is none."""
    found = [cb for cb in learn.cbs if type(cb).__name__ == "GradientAccumulation"]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError("unison.fastai: two GradientAccumulation callbacks; keep one")
    found[0].run = False
    return Accumulation(int(found[0].n_acc))

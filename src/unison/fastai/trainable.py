"""fastai's `freeze`, `unfreeze` and `fine_tune` under the bridge: DDP synchronises the gradients of the
parameters that required one when it wrapped the model, and no others. fastai freezes by switching
`requires_grad` (`Optimizer.freeze_to`: a frozen group's parameters stop taking gradients, its
BatchNorm's stay with `train_bn`); the optimizer's parameter groups and their hyper-parameters (the
discriminative rates of `fine_tune`'s `slice`) are the same on every rank and need nothing.

So the set of parameters that train is watched at each training epoch: where it differs from the set
DDP was built with (a body frozen by `vision_learner(pretrained=True)` before `distrib_ctx`, then
unfrozen by `fine_tune`; or unfrozen, then frozen), the strategy wraps the model again
(`DistributedTrainer.rewrap`) before the epoch runs, on every rank at the same point. Without it, a
body unfrozen after wrapping would train on each rank's own gradient (ranks drifting apart, silently),
and a body frozen after wrapping would stop DDP at its next forward."""

from __future__ import annotations

from typing import Any

import fastai.callback.core as fastai_core

import unison.engine as engine

__all__ = ["TrainableSync"]


class TrainableSync(fastai_core.Callback):
    """Wraps the model in DDP again when the parameters that require a gradient changed since it was
    wrapped (`unison.engine.follow_trainable`), before each training epoch (W > 1)."""

    order = -6  # before the bridge (-5) starts the engine's pass

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge

    def before_train(self) -> None:
        if self.bridge.world_size == 1:
            return
        host = self.bridge.host
        engine.follow_trainable(host)
        self.learn.model = host.model

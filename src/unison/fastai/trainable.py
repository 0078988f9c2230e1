"""fastai's `freeze`, `unfreeze` and `fine_tune` under the bridge: DDP synchronises the gradients of the
parameters that required one when it wrapped the model, and no others. fastai freezes by switching
`requires_grad` (`Optimizer.freeze_to`: a frozen group's parameters stop taking gradients, its
BatchNorm's stay with `train_bn`); the optimizer's parameter groups and their hyper-parameters (the
discriminative rates of `fine_tune`'s `slice`) are the same on every rank and need nothing.

So the set of parameters that train is watched at each training batch: where it differs from the set
DDP was built with (a body frozen by `vision_learner(pretrained=True)` before `distrib_ctx`, then
unfrozen by `fine_tune`; or unfrozen, then frozen), the strategy wraps the model again
(`DistributedTrainer.rewrap`) before the batch runs, on every rank at the same batch. Without it, a
body unfrozen after wrapping would train on each rank's own gradient (ranks drifting apart, silently),
and a body frozen after wrapping would stop DDP at its next forward."""

from __future__ import annotations

from typing import Any

import fastai.callback.core as fastai_core

import unison.engine as engine

__all__ = ["TrainableSync"]


class TrainableSync(fastai_core.Callback):
    """Wraps the model in DDP again when the parameters that require a gradient change (W > 1)."""

    order = -6  # before the bridge (-5) fires the engine's before_batch (DDP's no_sync)

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        self.wrapped = self.trainable()  # the set DDP was built with (to_distributed)

    def trainable(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.bridge.host.raw_model.parameters())

    def before_batch(self) -> None:
        if not self.learn.training or self.bridge.world_size == 1:
            return
        now = self.trainable()
        if now == self.wrapped:
            return
        host = self.bridge.host
        rewrap = getattr(host.strategy, "rewrap", None)
        if rewrap is None:
            raise ValueError(
                f"unison.fastai: the parameters that train changed inside distrib_ctx (freeze, unfreeze, "
                f"fine_tune) and the {type(host.strategy).__name__} strategy cannot synchronise the new "
                f"set; set requires_grad before distrib_ctx"
            )
        engine.use_parts(host, rewrap(engine.training_parts(host)))
        self.learn.model = host.model
        self.wrapped = now

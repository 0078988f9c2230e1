"""What a `Learner` refuses before it trains, each in one line naming the fix: arguments of the
wrong kind, a one-cycle schedule or gradient accumulation over a stream of unknown length, a
batch on another device than the model, a model on the meta device.

    check_learner_args(dls, model, nn.CrossEntropyLoss(), torch.optim.AdamW, 1e-3, None)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from unison.callbacks.schedule import OneCycleScheduler
from unison.callbacks.training import GradientAccumulation
from unison.data.batch import DataLoaders, tensors_in
from unison.data.checks import refuse_empty_train
from unison.data.stream import loader_length
from unison.optim import check_lr


def check_learner_args(
    dls: Any, model: Any, loss_func: Any, opt_func: Any, lr: Any, steps_per_epoch: Any
) -> None:
    """`Learner(...)`'s arguments, checked before anything is built."""
    if not isinstance(dls, DataLoaders):
        raise TypeError(
            f"Learner: dls must be a unison.DataLoaders, got {type(dls).__name__} "
            "(wrap your loaders: DataLoaders(train_dl, valid_dl))"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"Learner: model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_func is not None and not callable(loss_func):
        raise TypeError(
            f"Learner: loss_func must be a callable(pred, *targets) returning the mean batch "
            f"loss (or a SummedLoss), or None for the model's own loss, got {loss_func!r}"
        )
    if not callable(opt_func):
        raise TypeError(f"Learner: opt_func must be a callable(params, lr=lr), got {opt_func!r}")
    check_lr(lr)
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
        raise ValueError(f"Learner: steps_per_epoch must be a positive int or None: {steps_per_epoch}")


def refuse_unknown_length(train: Any, steps_per_epoch: int | None, needs: str) -> None:
    """What `needs` the epoch's length (the one-cycle schedule; gradient accumulation, to end each
    epoch with a step) refuses a stream without one at `fit`."""
    if isinstance(getattr(train, "dataset", None), IterableDataset) and steps_per_epoch is None:
        if loader_length(train) is None:
            raise ValueError(
                f"fit: {needs} needs the epoch's length, and the train stream "
                f"({type(train.dataset).__name__}) has no len(): give the dataset a __len__ or pass "
                "Learner(steps_per_epoch=...)"
            )


def check_devices(device: torch.device, batch: Any) -> None:
    """The model holds data, and the batch is where the model is (checked on a pass's first batch)."""
    if device.type == "meta":
        raise RuntimeError(
            "the model's parameters are on the meta device (no data): materialise it with "
            "model.to_empty(device=...) and initialise or load its weights before training"
        )
    for t in tensors_in(batch):
        if t.device != device:
            raise RuntimeError(
                f"a batch tensor is on {t.device} but the model is on {device}: move the model "
                "or stop moving the batch (the Learner moves batches to the model's device)"
            )


def check_fit_args(learn: Any, n_epoch: int, lr: Any, cbs: Any) -> None:
    """What `fit(n_epoch, lr, cbs)` refuses before anything changes: a bad epoch count or LR, an
    empty train set, a one-cycle schedule over a stream of unknown length."""
    if not isinstance(n_epoch, int) or isinstance(n_epoch, bool) or n_epoch < 0:
        raise ValueError(f"fit: n_epoch must be a non-negative int, got {n_epoch!r}")
    if lr is not None:
        check_lr(lr)
    refuse_empty_train(learn.dls.train)
    if any(isinstance(cb, OneCycleScheduler) for cb in [*learn.cbs, *cbs]):
        refuse_unknown_length(learn.dls.train, learn.steps_per_epoch, "the one-cycle schedule")
    if any(isinstance(cb, GradientAccumulation) for cb in [*learn.cbs, *cbs]):
        # (an epoch's last batch it cannot see would carry its gradient into the next epoch's step)
        refuse_unknown_length(
            learn.dls.train, learn.steps_per_epoch, "GradientAccumulation (to end each epoch with a step)"
        )

"""`to_distributed`, `detach_distributed` and `distrib_ctx` for a fastai `Learner` (re-exported by
`unison.fastai`; `unison.fastai.learner_methods` adds them to `Learner` as methods)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from fastai.callback.progress import ProgressCallback

import unison.engine as engine
from unison.callbacks.preemption import handling
from unison.distributed.strategy import ParallelConfig
from unison.fastai.bridge import UnisonBridge
from unison.fastai.mixing import GlobalBatchMixing
from unison.fastai.progress import use_launch_progress
from unison.fastai.trainable import TrainableSync

__all__ = ["detach_distributed", "distrib_ctx", "get_bridge", "to_distributed"]


def to_distributed(
    learn: Any,
    cuda_id: int | None = None,
    sync_bn: bool = True,
    timeout: float | None = None,
    backend: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    **ddp_kwargs: Any,
) -> Any:
    """Train fastai Learner `learn` data-parallel over the launch's processes (a no-op wrapper on
    one): joins the process group, makes BatchNorm exact, wraps the model in DDP. Returns `learn`.
    Options are unison's `distrib_ctx` options (`timeout` names a stalled rank after that many seconds),
    and `checkpoint_every=k` (the engine's checkpoint every k steps and at each epoch's end, under
    `learn.path / learn.model_dir`), `resume=True` (the next fit continues from the newest one, mid-epoch:
    with `unison launch --max-restarts`, a killed job comes back to the uninterrupted weights).

        learn = to_distributed(tabular_learner(dls, metrics=accuracy))
    """
    if get_bridge(learn) is not None:
        raise RuntimeError("unison.fastai.to_distributed: this Learner is distributed already")
    config = ParallelConfig.from_arguments(cuda_id, sync_bn, timeout, backend, False, **ddp_kwargs)
    bridge = UnisonBridge(learn, config, checkpoint_every, resume)
    # (MixUp and CutMix mix the global batch, with draws one process makes: unison.fastai.mixing)
    bridge.mixing = GlobalBatchMixing(bridge.host.collective)
    # (freeze / unfreeze / fine_tune: DDP wrapped again over the parameters that train now)
    bridge.trainable = TrainableSync(bridge)
    learn.add_cbs([bridge, bridge.after_recorder, bridge.mixing, bridge.trainable])
    if bridge.world_size > 1:
        # fastai's own gathers read WORLD_SIZE; the bridge hands fastai every rank's rows already.
        bridge.saved_world_size = set_world_size_env("1")
        if bridge.host.collective.rank != 0:
            learn.remove_cb(ProgressCallback)  # rank 0 alone shows progress, as in fastai's distrib_ctx
    # fastai's bar live under a launcher, one line per epoch in a log (rank 0's: no other has one now)
    bridge.restore_progress = use_launch_progress(learn)
    return learn


def detach_distributed(learn: Any) -> Any:
    """Undo `to_distributed`: the model unwrapped with plain BatchNorm, progress back, the process
    group left if `to_distributed` made it. Returns `learn`."""
    bridge = get_bridge(learn)
    if bridge is None:
        return learn
    distributed = bridge.world_size > 1  # (read before the group is left)
    try:
        bridge.restore()
    finally:
        learn.remove_cbs([bridge, bridge.after_recorder, bridge.mixing, bridge.trainable])
        bridge.restore_progress()
        if distributed:
            set_world_size_env(bridge.saved_world_size)
            if not any(isinstance(cb, ProgressCallback) for cb in learn.cbs):
                learn.add_cb(ProgressCallback())
    return learn


@contextlib.contextmanager
def distrib_ctx(learn: Any, **options: Any) -> Iterator[Any]:
    """`to_distributed(learn, **options)` inside the block, `detach_distributed` after it; a failed
    collective caused by another rank stopping raises the error naming that rank. With checkpoints
    (`checkpoint_every`, `resume`), a preemption signal (SIGTERM, SIGUSR1) checkpoints every rank at
    one step and exits 75; the job started again with `resume=True` continues there.

        with distrib_ctx(learn):
            learn.fit_one_cycle(3, 1e-2)
    """
    to_distributed(learn, **options)
    bridge = get_bridge(learn)
    assert bridge is not None
    try:
        with handling(bridge.host):  # preemption signals, with checkpoint_every / resume
            yield learn
    except Exception as exc:
        engine.name_stalled_rank(bridge.host, exc)
        raise
    finally:
        detach_distributed(learn)


def get_bridge(learn: Any) -> UnisonBridge | None:
    """The `UnisonBridge` attached to `learn`, if any."""
    return next((cb for cb in learn.cbs if isinstance(cb, UnisonBridge)), None)


def set_world_size_env(value: str | None) -> str | None:
    """Set (None: remove) `WORLD_SIZE` in this process; returns what it was."""
    old = os.environ.get("WORLD_SIZE")
    if value is None:
        os.environ.pop("WORLD_SIZE", None)
    else:
        os.environ["WORLD_SIZE"] = value
    return old

"""fastai's distributed API as methods of fastai's `Learner`, added with `@patch` (fastai's own
convention; torch's classes are never patched), so that a stock fastai distributed script runs on
unison with its import changed from `from fastai.distributed import *` to `from unison.fastai import *`:

    with learn.distrib_ctx():                 # or learn.to_distributed() ... learn.detach_distributed()
        learn.fit_one_cycle(3, 1e-2)
    with learn.parallel_ctx():                # one process, DataParallel over its GPUs
        learn.fit(1)

Inside `distrib_ctx` on W > 1 processes, `learn.save`, `learn.load` and `learn.export` (and so
SaveModelCallback, which saves and loads through them) have one writer, rank 0, and return on every
rank once the file is whole; a rank's failure is raised on every rank, naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from fastai.callback.core import Callback
from fastai.learner import Learner
from fastcore.basics import patch

import unison.fastai.distributed as bridge_api
from unison.fastai.files import plain_learner, together

__all__ = ["ParallelTrainer"]

_fastai_save, _fastai_load, _fastai_export = Learner.save, Learner.load, Learner.export


class ParallelTrainer(Callback):
    """Wraps a fastai `Learner`'s model in torch's `DataParallel` during its fits (one process)."""

    order = -9  # after TrainEvalCallback (-10), before everything that reads the model

    def __init__(self, device_ids: Sequence[int] | None = None) -> None:
        self.device_ids = device_ids

    def before_fit(self) -> None:
        from unison.distributed.trainer import DataParallel  # (torch's, plus `reset()` for RNNs)

        self.learn.model = DataParallel(self.learn.model, device_ids=self.device_ids)

    def after_fit(self) -> None:
        self.learn.model = self.learn.model.module


@patch
def to_distributed(self: Learner, cuda_id: int | None = None, sync_bn: bool = True, **kwargs: Any) -> Learner:
    """`unison.fastai.to_distributed(self, cuda_id, sync_bn, **kwargs)`: train data-parallel over the
    launch's processes (unison's options: `timeout`, `checkpoint_every`, `resume`, DDP's keywords)."""
    return bridge_api.to_distributed(self, cuda_id, sync_bn, **kwargs)


@patch
def detach_distributed(self: Learner) -> Learner:
    """Undo `to_distributed`: the plain model back, progress back, the group left if it was made here."""
    return bridge_api.detach_distributed(self)


@patch
@contextlib.contextmanager
def distrib_ctx(
    self: Learner, cuda_id: int | None = None, sync_bn: bool = True, in_notebook: bool = False, **kwargs: Any
) -> Iterator[Learner]:
    """fastai's `with learn.distrib_ctx(): ...` on unison: `to_distributed` inside the block,
    `detach_distributed` after it. `in_notebook` is accepted for fastai's signature: the process
    group is joined either way (`unison.spawn` starts a notebook's processes)."""
    with bridge_api.distrib_ctx(self, cuda_id=cuda_id, sync_bn=sync_bn, **kwargs):
        yield self


@patch
def to_parallel(self: Learner, device_ids: Sequence[int] | None = None) -> Learner:
    """Train with torch's `DataParallel` over `device_ids` (all GPUs by default) in this one process."""
    self.add_cb(ParallelTrainer(device_ids))
    return self


@patch
def detach_parallel(self: Learner) -> Learner:
    """Undo `to_parallel`."""
    self.remove_cb(ParallelTrainer)
    return self


@patch
@contextlib.contextmanager
def parallel_ctx(self: Learner, device_ids: Sequence[int] | None = None) -> Iterator[Learner]:
    """`to_parallel` inside the block, `detach_parallel` after it."""
    try:
        yield self.to_parallel(device_ids)
    finally:
        self.detach_parallel()


@patch
def save(self: Learner, file: Any, **kwargs: Any) -> Any:
    """fastai's `save`; inside `distrib_ctx`, rank 0 writes and every rank returns once it is whole."""
    return _together(self, f"learn.save({file!r})", lambda: _fastai_save(self, file, **kwargs))


@patch
def load(self: Learner, file: Any, device: Any = None, **kwargs: Any) -> Learner:
    """fastai's `load`; inside `distrib_ctx`, a rank that cannot read the file stops every rank, named."""
    return _together(self, f"learn.load({file!r})", lambda: _fastai_load(self, file, device=device, **kwargs))


@patch
def export(self: Learner, fname: Any = "export.pkl", **kwargs: Any) -> None:
    """fastai's `export`, of the plain model; inside `distrib_ctx`, rank 0 writes, every rank waits."""
    bridge = bridge_api.get_bridge(self)
    if bridge is None:
        return _fastai_export(self, fname, **kwargs)

    def plain_export() -> None:
        with plain_learner(self, bridge.host.raw_model):
            _fastai_export(self, fname, **kwargs)

    return _together(self, f"learn.export({fname!r})", plain_export)


def _together(learn: Learner, what: str, work: Any) -> Any:
    bridge = bridge_api.get_bridge(learn)
    if bridge is None or not bridge.shares_files:
        return work()
    return together(bridge.host.collective, what, work)  # one writer, every rank's outcome on every rank

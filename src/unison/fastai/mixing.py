"""fastai's MixUp and CutMix (any `MixHandler`) on W processes, exactly: each step mixes the global
batch, as one process at batch `W*bs` mixes its batch.

fastai's `MixUp` draws a weight per row (`lam`, shape `(bs,)`) and pairs each row with another of
the same batch (`torch.randperm(bs)`); `CutMix` draws one box per batch. On W ranks each would draw
for its own share and pair rows only with its own. Here (`GlobalBatchMixing`, added by
`to_distributed`) every rank gathers the step's global batch (inputs and targets, in data order),
runs fastai's own `before_batch` on it with the generators seeded from the epoch's seed and the
step, and keeps its own rows of the mixed inputs, of the partners' targets and of `lam`: the pairs
and weights are one process's. The cost: an all-gather of each training batch's inputs and targets,
and every rank mixing the whole global batch (a `lerp` over W times its rows).

fastai runs the handler's events itself unless its `run` is off: the handler is driven from here
for the fit (fastai sets `run` back at `after_fit`).
"""

from __future__ import annotations

from typing import Any

import torch
from fastai.callback.core import Callback
from fastai.torch_core import retain_type

from unison.data.batch import batch_size_of
from unison.fastai.augment import epoch_seed
from unison.rng import mix_seed, seeded_draws

__all__ = ["GlobalBatchMixing"]


class GlobalBatchMixing(Callback):
    """Drives the fit's fastai `MixHandler` callbacks (MixUp, CutMix) on the global batch (see the
    module's docstring). `collective` is the bridge's (`Collective.gather_ordered`)."""

    order = 0  # fastai's MixUp's own place: after the bridge (-5) has trimmed this rank's batch
    run_valid = False

    def __init__(self, collective: Any) -> None:
        self.collective = collective
        self.mixers: list[Any] = []
        self.seed = 0

    def before_fit(self) -> None:
        from fastai.callback.mixup import MixHandler

        self.mixers = [cb for cb in self.learn.cbs if isinstance(cb, MixHandler)]
        for mixer in self.mixers:
            mixer.run = False  # (run from here; fastai turns it back on at after_fit)

    def before_train(self) -> None:
        # (the loader's generator as the epoch starts: the same on every rank, restored by a resume)
        self.seed = epoch_seed(self.learn.dls.train.rng)
        for mixer in self.mixers:
            mixer.before_train()

    def before_batch(self) -> None:
        if not self.mixers:
            return
        learn, collective = self.learn, self.collective
        rows = batch_size_of(learn.yb) if learn.yb else batch_size_of(learn.xb)
        # This rank's rows are the global batch's rank, rank + W, ... (the strided plan).
        mine = torch.arange(
            collective.rank, collective.rank + collective.world_size * rows, collective.world_size
        )
        xb, yb = learn.xb, learn.yb
        learn.xb = tuple(_gathered(collective, x) for x in xb)
        learn.yb = tuple(_gathered(collective, y) for y in yb)
        global_rows = batch_size_of(learn.yb) if learn.yb else batch_size_of(learn.xb)
        device = learn.xb[0].device if learn.xb else None
        with seeded_draws(mix_seed(self.seed, learn.iter, "mix"), device):
            for mixer in self.mixers:
                mixer.before_batch()
        learn.xb = _rows(learn.xb, mine, global_rows, xb)
        learn.yb = _rows(learn.yb, mine, global_rows, yb)
        for mixer in self.mixers:
            if hasattr(mixer, "yb1"):
                mixer.yb1 = _rows(mixer.yb1, mine, global_rows, yb)
            if isinstance(getattr(mixer, "lam", None), torch.Tensor):
                mixer.lam = _rows(mixer.lam, mine, global_rows)

    def after_train(self) -> None:
        for mixer in self.mixers:
            mixer.after_train()

    after_cancel_train = after_cancel_fit = after_train

    def after_fit(self) -> None:
        self.mixers = []


def _gathered(collective: Any, t: Any) -> Any:
    return retain_type(collective.gather_ordered(t), old=t) if isinstance(t, torch.Tensor) else t


def _rows(x: Any, mine: torch.Tensor, global_rows: int, like: Any = None) -> Any:
    """This rank's rows (`mine`) of every tensor in `x` that has one per row of the global batch; a
    tensor of another length (CutMix's one `lam`) is kept whole."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] != global_rows:
            return x
        kept = x[mine.to(x.device)]
        return retain_type(kept, old=like) if isinstance(like, torch.Tensor) else kept
    if isinstance(x, (tuple, list)):
        likes = like if isinstance(like, (tuple, list)) and len(like) == len(x) else [None] * len(x)
        return type(x)(_rows(part, mine, global_rows, old) for part, old in zip(x, likes, strict=True))
    return x

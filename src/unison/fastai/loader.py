"""`RankShardedFastaiDL`: this rank's share of a fastai `DataLoader`, in the order fastai's own
shuffle deals one process, following unison's rank-sharded loader protocol
(`unison.data.ranked.RankShardedLoader`).

fastai draws an epoch's order with `dl.get_idxs()` (its own `random.Random`, reseeded from itself
every epoch). Every rank builds the same loader from the same seed, so every rank draws the same
order; this loader asks the wrapped fastai loader for it, then keeps the positions unison's plan
gives this rank (`unison.data.plan.strided_plan`: rank `r` of `W` takes `r, r+W, ...`, so the
k-th batches of all ranks together are the k-th batch of one process at batch `W*bs`). Training
deals exactly the set's items, none twice; evaluation pads by wrapping, and `real_rows(k)` says
how many leading rows of batch `k` are real (the bridge trims the rest before anything scores them).

Batches are made by the wrapped loader (its `create_batches`, transforms, device), as fastai's
own `DistributedDL` does; unlike it, nothing here broadcasts through `.cuda()` and no padded item
is ever counted.

    sharded = RankShardedFastaiDL(dls.train, rank=1, world_size=2, pad=False)
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import PurePath
from typing import Any

from fastai.data.core import TfmdDL
from fastai.data.load import _FakeLoader
from fastai.torch_core import to_detach
from fastcore.foundation import L

from unison.data.plan import PositionPlan, RankPlan, strided_plan
from unison.fastai.augment import (
    after_batch_by_item,
    draws_by_position,
    epoch_seed,
    random_transforms,
    refuse_unseeded,
    seeded_batches,
)

__all__ = ["RankShardedFastaiDL", "check_loader_agrees", "check_loaders_agree", "needs_share"]


class RankShardedFastaiDL(TfmdDL):
    """This rank's share of fastai loader `dl` (see the module's docstring)."""

    def __init__(self, dl: Any, rank: int, world_size: int, pad: bool) -> None:
        # Like fastai's own DistributedDL: no TfmdDL.__init__ (it would build a second pipeline);
        # the wrapped loader makes every batch.
        self.dl, self.rank, self.world_size, self.pad = dl, rank, world_size, pad
        self.bs, self.drop_last, self.dataset = dl.bs, dl.drop_last, dl.dataset
        self.num_workers, self.offs, self.pin_memory = dl.num_workers, dl.offs, dl.pin_memory
        self.device = dl.device
        fake = dl.fake_l
        self.fake_l = _FakeLoader(
            self,
            fake.pin_memory,
            fake.num_workers,
            fake.timeout,
            persistent_workers=fake.persistent_workers,
            pin_memory_device=fake.pin_memory_device,
        )
        self._plan: RankPlan | PositionPlan = RankPlan([], [0], [])  # (of positions in the epoch's order)
        self._start = 0
        # Augmentation drawn by position (unison.fastai.augment): the epoch's seed, the next batch.
        self.by_position, self.seed, self._next_batch = draws_by_position(dl), 0, 0
        if world_size > 1:
            refuse_unseeded(dl)
        self.on_drawn: Any = None  # called once after the next epoch's order is drawn (a resume)

    # ---- the plan ----------------------------------------------------------------------
    @property
    def n_global(self) -> int:
        """Items in one epoch of the wrapped loader (what one process iterates)."""
        return int(self.dl.n)

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank (and one process's count at batch `W*bs`)."""
        n, world, bs = self.n_global, self.world_size, self.bs
        if self.pad:
            return math.ceil(math.ceil(n / world) / bs)
        global_bs = world * bs
        return n // global_bs if self.drop_last else math.ceil(n / global_bs)

    def get_idxs(self) -> list[Any]:
        self.seed = epoch_seed(self.dl.rng)  # (before the order moves it: the same on every rank)
        order = list(self.dl.get_idxs())  # fastai's own order for this epoch, drawn alike on every rank
        if self.on_drawn is not None:
            drawn, self.on_drawn = self.on_drawn, None
            drawn()
        positions = list(range(len(order)))
        self._plan = strided_plan(positions, self.rank, self.world_size, self.bs, len(self), self.pad)
        start, self._start = self._start, 0
        self._next_batch = start
        mine = [p for batch in self._plan.batches(start) for p in batch]
        # (index, position) keys where items are made seeded by position (`create_batches`)
        return [(order[p], p) for p in mine] if self.by_position else [order[p] for p in mine]

    # ---- unison's rank-sharded loader protocol -----------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """fastai's order follows its own generator, epoch after epoch: nothing to set."""

    def set_start(self, batch_index: int) -> None:
        self._start = int(batch_index)

    def real_rows(self, batch_index: int) -> int:
        real = self._plan.real
        return real[batch_index] if batch_index < len(real) else 0

    def global_rows(self, batch_index: int) -> int:
        global_bs = self.world_size * self.bs
        return max(0, min(global_bs, self.n_global - batch_index * global_bs))

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Nothing beyond the step (see `state_dict`)."""

    # ---- the wrapped loader does the rest ----------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.bs

    @property
    def n_inp(self) -> int:
        return self.dl.n_inp

    def randomize(self) -> None:
        self.dl.randomize()

    def before_iter(self) -> None:
        self.dl.before_iter()

    def after_batch(self, b: Any) -> Any:
        if not (self.by_position and random_transforms(self.dl.after_batch)):
            return self.dl.after_batch(b)
        # (batches come back in order from fastai's workers too: batch k is the plan's k-th)
        positions, self._next_batch = self._plan.batch(self._next_batch), self._next_batch + 1
        return after_batch_by_item(self.dl, b, positions, self.seed)

    def after_iter(self) -> None:
        self.dl.after_iter()

    def create_batches(self, samps: Any) -> Any:
        if self.by_position:
            return seeded_batches(self.dl, samps, self.seed)
        return self.dl.create_batches(samps)

    def decode(self, b: Any) -> Any:
        return self.dl.decode(b)

    def decode_batch(self, b: Any, max_n: int = 9, full: bool = True) -> Any:
        return self.dl.decode_batch(b, max_n, full)

    def to_detach(self, b: Any, cpu: bool = True, gather: bool = True) -> Any:
        """Detached, never gathered again: the bridge hands fastai every rank's rows already."""
        return to_detach(b, cpu, gather=False)

    def __repr__(self) -> str:
        return f"RankShardedFastaiDL(rank={self.rank}, world_size={self.world_size}, batches={len(self)})"


def needs_share(dl: Any, world_size: int, checkpointing: bool) -> bool:
    """Whether `dl` trains through a `RankShardedFastaiDL`: on W > 1 processes, on one with checkpoints
    (a resume starts mid-epoch), and on one where its augmentation is drawn by position (so that one
    process draws what W do). Batches that are not a fastai loader (`show_results`'s `[batch]`) are
    this process's own: none."""
    from fastai.data.load import DataLoader

    return isinstance(dl, DataLoader) and (world_size > 1 or checkpointing or draws_by_position(dl))


def check_loaders_agree(dls: Any, collective: Any) -> None:
    """Every rank must deal the same order of the same items: same items count, batch size, fastai
    generator state (a script that seeds before building its loaders has them) and, where they are a
    table or a list of paths, names or numbers, items (`items_digest`); else one line naming it."""
    mine = {
        name: (int(dl.n), int(dl.bs), bool(dl.shuffle), epoch_seed(dl.rng), items_digest(dl))
        for name, dl in (("train", dls.train), ("valid", dls.valid))
        if dl is not None
    }
    everyone = collective.gather_objects(mine)
    for name in mine:
        others = [r for r, theirs in enumerate(everyone) if theirs.get(name) != everyone[0].get(name)]
        if others:
            raise ValueError(
                f"unison.fastai: the {name} loader differs on rank(s) {others} from rank 0 (items, batch "
                f"size or shuffle order; rank 0: n={everyone[0][name][0]}, bs={everyone[0][name][1]}): "
                "build every rank's DataLoaders from the same items, seeded alike (fastai's set_seed), "
                "and the bridge deals each rank its share"
            )


def check_loader_agrees(dl: Any, collective: Any) -> None:
    """The loader of a `validate(dl=...)`, `get_preds(dl=...)` or `predict(item)` must be one loader on
    every rank (its items are dealt across ranks and every prediction gathered on every rank): same item
    count, batch size and, where they are a table or a list of paths, names or numbers, items; else one
    line."""
    mine = (int(dl.n), int(dl.bs), items_digest(dl))
    everyone = collective.gather_objects(mine)
    others = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if others:
        (n0, bs0, _), (n, bs, _) = everyone[0], everyone[others[0]]
        raise ValueError(
            f"unison.fastai: validate/get_preds/predict on a loader that differs on rank(s) {others} from "
            f"rank 0 (rank 0: n={n0}, bs={bs0}; rank {others[0]}: n={n}, bs={bs}, or other items): inside "
            "distrib_ctx every rank passes the same loader and gets every prediction; to predict each "
            "rank's own items, call it outside distrib_ctx"
        )


def items_digest(dl: Any) -> str | None:
    """A digest of `dl`'s items where they are a pandas table or a list of paths, names or numbers
    (fastai's tabular and image loaders); None where they are anything else."""
    pandas = sys.modules.get("pandas")  # (imported already where the items are a table)
    items = getattr(dl.dataset, "items", dl.dataset)
    digest = hashlib.blake2b(digest_size=8)
    if pandas is not None and isinstance(items, pandas.DataFrame):
        try:
            digest.update(pandas.util.hash_pandas_object(items).to_numpy().tobytes())
        except TypeError:  # (cells pandas cannot hash: lists, dicts)
            return None
    elif isinstance(items, (list, tuple, L)):
        for item in items:
            if not isinstance(item, (str, PurePath, int, float)):
                return None
            digest.update(f"{item}\0".encode())
    else:
        return None
    return digest.hexdigest()

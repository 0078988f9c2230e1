"""Each loader's sharded form, made once and kept across epochs: a map-style loader becomes a
`DistributedDL` (the global order strided over ranks), a stream a `StreamDL`.

    shards = LoaderShards()
    dl = shards.get(train_dl, pad=False, collective=c, epoch=0, seed=7)
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from unison.data.drawn import DrawnOrder
from unison.data.loader import DistributedDL
from unison.data.ranked import RankShardedLoader
from unison.data.stream import StreamDL


class LoaderShards:
    """The learner's cache of sharded loaders, keyed by loader and padding; cleared when the
    collective or the data seed changes (another world, another order)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, bool], tuple[DataLoader, RankShardedLoader]] = {}
        self._drawn: dict[int, tuple[DataLoader, DrawnOrder]] = {}  # kept across clear()

    def draw_from(self, dl: DataLoader, drawn: DrawnOrder) -> None:
        """Shard `dl` in the orders `drawn` gives (as `dl` itself draws them), not the seed's."""
        self._drawn[id(dl)] = (dl, drawn)
        self._cache = {key: value for key, value in self._cache.items() if value[0] is not dl}

    def clear(self) -> None:
        self._cache.clear()

    def get(
        self,
        dl: DataLoader | RankShardedLoader,
        pad: bool,
        collective: Any,
        epoch: int,
        seed: int,
        steps_per_epoch: int | None = None,
        split: str = "exact",
    ) -> DataLoader | RankShardedLoader:
        """This rank's share of `dl` for `epoch`, in the order set by `seed`.

        Training (`pad=False`) splits the last global batch unevenly: no item twice. Evaluation
        pads by wrapping and trims the padding from the inputs. A stream (`IterableDataset`)
        is strided by `StreamDL` (or shards itself), every rank taking the same number of steps."""
        if isinstance(dl, RankShardedLoader):  # already one rank's share (is_rank_sharded)
            return dl
        world = collective.world_size
        streaming = isinstance(dl.dataset, IterableDataset)
        if world == 1 and not streaming and dl.batch_size is None and dl.batch_sampler is None:
            return dl  # one process, no batching: used as it is
        key = (id(dl), pad)
        if key not in self._cache or self._cache[key][0] is not dl:
            sharded: RankShardedLoader
            if streaming:
                steps = None if pad else steps_per_epoch  # bounds training epochs only
                sharded = StreamDL(dl, collective.rank, world, collective, steps, seed=seed, split=split)
            else:
                own = self._drawn.get(id(dl))
                drawn = own[1] if own is not None and own[0] is dl else None
                sharded = DistributedDL(dl, collective.rank, world, seed=seed, pad=pad, drawn=drawn)
            self._cache[key] = (dl, sharded)
        sharded = self._cache[key][1]
        sharded.set_epoch(epoch)
        return sharded

"""The protocol every rank-sharded loader follows (`DistributedDL` for map-style data, `StreamDL`
for streams): what the training loop, the exact loss and the checkpoint ask of this rank's share
of a loader, whichever kind it is.

- `set_epoch(epoch)`: the next iteration plays `epoch`'s order (the same on every rank).
- `set_start(batch_index)`: the next iteration starts at that global step (a resume), nothing
  before it loaded twice.
- `real_rows(batch_index)`: how many leading rows of this rank's batch are real items; the rest
  is padding added to keep every rank in step, which nothing may score.
- `global_rows(batch_index)`: real items of that step over every rank (the exact loss's count).
- `state_dict()` / `load_state_dict(state)`: what a resume needs beyond the step (a stateful
  stream's position; None for a loader the step alone places).

>>> from torch.utils.data import DataLoader
>>> is_rank_sharded(DataLoader(range(4), batch_size=2))
False
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RankShardedLoader(Protocol):
    """This rank's share of a loader, iterated one epoch at a time (see the module's docstring)."""

    def set_epoch(self, epoch: int) -> None: ...

    def set_start(self, batch_index: int) -> None: ...

    def real_rows(self, batch_index: int) -> int: ...

    def global_rows(self, batch_index: int) -> int: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


def is_rank_sharded(dl: Any) -> bool:
    """Whether `dl` is already one rank's share (a `DistributedDL`, a `StreamDL`, or any loader that
    follows `RankShardedLoader`), so that nothing shards it again.

    >>> is_rank_sharded(None)
    False
    """
    # Asked every batch: a runtime protocol check of an instance costs 7-14 us, a remembered one of
    # its class nothing (the protocol has methods only, so a class answers for its instances).
    cls = type(dl)
    known = _SHARDED_TYPES.get(cls)
    if known is None:
        known = _SHARDED_TYPES[cls] = issubclass(cls, RankShardedLoader)
    return known


_SHARDED_TYPES: dict[type, bool] = {}

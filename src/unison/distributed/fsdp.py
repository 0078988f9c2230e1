"""Whether a model is sharded with torch's FSDP2 (`fully_shard`): a question callbacks, trainers
and checkpoints all ask, answered in a module that imports none of them."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """True when `model` was sharded with `fully_shard` (its parameters are DTensor shards).

    For example:

        is_sharded(torch.nn.Linear(2, 2))
    """
    return isinstance(model, FSDPModule)

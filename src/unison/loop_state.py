"""What a training loop is made of and where it starts, as values handed between the engine, the
strategies and the checkpoint: a strategy's `setup` takes and returns `TrainingParts`; a checkpoint's
restore and a torchft heal return a `StartPoint`; the engine puts either in place on the loop
(`unison.engine.use_parts`, `unison.engine.start_fit`). Nothing here imports torch.distributed.

>>> StartPoint(epoch=2, step=5)
StartPoint(epoch=2, step=5, data_seed=None, stream_state=None, scaler_state=None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from unison.distributed.collective import Collective


@dataclass(frozen=True)
class TrainingParts:
    """What a loop trains with: the model (wrapped by a strategy while it is set up), the optimizer
    over it, the collective that shards its loaders and reduces its metrics, and the seed of its
    data order (rank 0's in a job, so that every rank deals the same order)."""

    model: nn.Module
    opt: torch.optim.Optimizer | None
    collective: Collective
    data_seed: int


@dataclass(frozen=True)
class StartPoint:
    """Where a fit starts: `epoch` and the training `step` within it (0, 0 for a fresh fit), and
    what a checkpoint or a torchft peer carries of the loop besides weights: the data order's
    seed, this rank's state of a stateful stream, and the fp16 grad scaler's state (None: keep
    the loop's own)."""

    epoch: int = 0
    step: int = 0
    data_seed: int | None = None
    stream_state: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None

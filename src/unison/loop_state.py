"""What a training loop is made of, where it starts and the batch in flight, as values handed
between the engine, the strategies and the checkpoint: a strategy's `setup` takes and returns
`TrainingParts`; a checkpoint's restore and a torchft heal return a `StartPoint`; the engine puts
either in place on the loop (`unison.engine.use_parts`, `unison.engine.start_fit`). Each batch is a
new `BatchState` (`unison.engine.prepare_batch`), which the loops show under fastai's names
(`learn.xb`, `learn.loss`, ...). Nothing here imports torch.distributed.

>>> StartPoint(epoch=2, step=5)
StartPoint(epoch=2, step=5, data_seed=None, stream_state=None, scaler_state=None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

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


@dataclass
class BatchState:
    """The batch in flight on this rank: its inputs and targets (padding rows trimmed), the inputs
    as they came (`padded_xb`: an empty share's forward pass runs on them), whether this rank has no
    row of it, and what the step made of it: the prediction, the loss (its mean), what to
    backpropagate and the count of the loss's terms (samples, tokens)."""

    xb: tuple[Any, ...] = ()
    yb: tuple[Any, ...] = ()
    padded_xb: tuple[Any, ...] = field(default=())
    empty_share: bool = False
    pred: Any = None
    loss: Tensor | None = None
    loss_grad: Tensor | None = None
    loss_count: float = 0.0

"""What a torchft step sums across replicas: one flat vector of every trained parameter's gradient,
then two riders, the share's summed loss and its count (`StepVector`).

Under torchft every rank computes its share of the global batch alone (its collective is inactive),
so the exact loss (`unison.exact_loss`) divides its gradient by what it can know by itself:

- a loss counted by rows (a mean loss): by the global batch's rows, from the loader's plan: the
  shares' gradients then just add up;
- a loss counted by anything else (`SummedLoss`, `TokenCrossEntropy`, `Run.loss(total, count=n)`):
  by the share's own count, as the global count is known only after the sum. The gradient is made
  the share's summed gradient again (times its count) before the sum, and divided by the global
  count (the summed count rider) after it. An empty share (count 0) adds nothing.

Either way every replica ends with the gradient of the whole global batch, and the loss of it.

    step = StepVector.pack(learn)
    manager.allreduce(step.flat).wait(); loss, count = step.unpack()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from unison.learner_view import LearnerView

__all__ = ["ReplicaGroupLostError", "StepVector", "group_sum"]


class ReplicaGroupLostError(RuntimeError):
    """A process of this replica group stopped: the group ends, and its launcher restarts it."""


def group_sum(flat: Tensor, replica_id: str) -> None:
    """Sum `flat` in place over this replica group (its own gloo group, `unison launch --nproc G`);
    a peer of the group that died or stalls ends the whole group (`ReplicaGroupLostError`).

        group_sum(step.flat, "a")
    """
    try:
        dist.all_reduce(flat)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ReplicaGroupLostError(
            f"replica {replica_id}: a process of this replica group stopped taking part "
            f"({first}): the group stops here and its launcher restarts it (--max-restarts); the "
            "other replicas redo the step without it"
        ) from exc


@dataclass
class StepVector:
    """A step's gradients and riders, flat, to be summed in place across ranks and replicas: each
    parameter's gradient (zeros where it has none), one flag per parameter (1 where it has one: a
    parameter no replica used keeps no gradient, as in one process, so AdamW leaves it alone), then
    the riders."""

    params: list[nn.Parameter]
    flat: Tensor
    riders: bool  # the last two entries are the share's summed loss and its count
    counted: bool  # the gradients are sums, to divide by the global count once summed

    @classmethod
    def pack(cls, learn: LearnerView) -> StepVector:
        """The vector of this rank's share of the step (see the module's docstring)."""
        params = [p for p in learn.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        used = [torch.tensor([float(p.grad is not None) for p in params])] if params else []
        riders = []
        if learn.loss is not None and grads:
            count = torch.tensor(float(learn.loss_count))
            riders = [torch.stack([learn.loss.detach().cpu() * count, count])]
        flat = torch.cat([*(g.reshape(-1) for g in grads), *(t.to(grads[0]) for t in used + riders)])
        counted = bool(riders) and learn.exact_loss.count_is_rows is False
        if counted:  # normalise_grads divided by the share's count: back to the share's sum
            flat[: sum(p.numel() for p in params)].mul_(float(learn.loss_count))
        return cls(params, flat, bool(riders), counted)

    def unpack(self) -> tuple[Tensor | None, float]:
        """Set each parameter's gradient from the summed vector (none where no replica had one);
        return the global batch's loss and count (the same on every replica: the recorder's
        train_loss), or (None, 0.0) without them."""
        flat = self.flat
        n_grads = sum(p.numel() for p in self.params)
        total = float(flat[-1]) if self.riders else 0.0
        if self.counted and total > 0:
            flat[:n_grads].div_(total)
        used = flat[n_grads : n_grads + len(self.params)].tolist()
        offset = 0
        for p, flag in zip(self.params, used, strict=True):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone() if flag else None
            offset += n
        if total > 0:  # (each rank of a group: the recorder's own sum keeps it)
            return flat[-2] / flat[-1], total
        return None, 0.0

"""The few collective operations the training loop needs, on one process or many.

The learner talks to a `Collective`, never to `torch.distributed` directly: on a
single process every operation is the identity, inside `distrib_ctx` each maps
onto one torch collective over the process group. This keeps the loop readable
and makes exactness (reduce state, never average averages) one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class Collective:
    """Collectives over `group` (the default process group), or identities when `world_size == 1`.

    >>> c = Collective()            # single process
    >>> c.sum(torch.tensor(2.0))
    tensor(2.)
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, device: torch.device | None = None, speaks: bool = True
    ):
        # `speaks=False`: a process that computes everything itself (its collectives are identities)
        # beside others that compute the same, such as rank 1 of a torchft replica group: it keeps
        # quiet and writes nothing, so the job speaks with one voice.
        self.speaks = speaks
        self.active = dist.is_available() and dist.is_initialized() and group is not None
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        # NCCL only moves CUDA tensors; gloo only CPU ones.
        self.device = device or torch.device("cpu")
        if self.world_size == 1:
            self.active = False
        # Rank 0 of the group, numbered as in the whole job: the source of a broadcast.
        self.root = dist.get_global_rank(group, 0) if self.active and group is not None else 0

    @property
    def is_main(self) -> bool:
        """The rank that prints, logs and writes (rank 0 of the group)."""
        return self.rank == 0 and self.speaks

    def sum(self, t: Tensor) -> Tensor:
        """Elementwise sum of `t` over all ranks (a new tensor, on `t`'s device)."""
        return self.start_sum(t)()

    def start_sum(self, t: Tensor) -> Callable[[], Tensor]:
        """Begin `sum(t)` without waiting for it (an asynchronous all-reduce); call what it returns for
        the sum. The network time then overlaps the caller's work (a backward pass) instead of adding
        to it; every rank must start it at the same point among its collectives, as any collective.

            total = collective.start_sum(torch.tensor([3.0]))
            loss.backward(); total()
        """
        if not self.active:
            return lambda: t
        buf = t.detach().to(self.device, copy=True)
        work = dist.all_reduce(buf, group=self.group, async_op=True)

        def result() -> Tensor:
            work.wait()
            return buf.to(t.device)

        return result

    def gather_ordered(self, t: Tensor, pad_value: float | None = 0, who: str = "gather_ordered") -> Tensor:
        """Rows of every rank's `t`, interleaved as `DistributedDL` strided them.

        Row `k` of rank `r` holds global position `r + k * world_size`; the result puts
        each row back at its global position. Ranks may hold different numbers of rows
        and different sizes past dim 0 (padded with `pad_value` to the largest; with
        `pad_value=None` that is a `ValueError`, its message starting with `who`).
        """
        if not self.active:
            return t
        shape = torch.tensor(t.shape, dtype=torch.long, device=self.device)
        shapes = [torch.empty_like(shape) for _ in range(self.world_size)]
        dist.all_gather(shapes, shape, group=self.group)
        sizes = torch.stack(shapes).tolist()
        if any(len(s) != t.dim() for s in sizes):
            raise ValueError(f"{who}: ranks hold tensors with different numbers of dimensions")
        other = next((r for r, size in enumerate(sizes) if size[1:] != sizes[0][1:]), None)
        if pad_value is None and other is not None:
            raise ValueError(
                f"{who}: the ranks' rows differ in size (rank 0's {tuple(sizes[0][1:])}, rank {other}'s "
                f"{tuple(sizes[other][1:])}): pad them to one size, or give pad_value= to fill the shorter "
                "rows"
            )
        max_shape = [max(s[d] for s in sizes) for d in range(t.dim())]
        fill = 0 if pad_value is None else pad_value  # (rows alone differ: no fill is kept)
        padded = t.new_full(max_shape, fill, device=self.device)
        padded[tuple(slice(0, n) for n in t.shape)] = t.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        rows = [p[: s[0]] for p, s in zip(parts, sizes, strict=True)]
        trailing = tuple(slice(0, n) for n in max_shape[1:])
        total = sum(s[0] for s in sizes)
        out = t.new_full([total, *max_shape[1:]], fill, device=self.device)
        for r, part in enumerate(rows):
            index = (slice(r, r + self.world_size * len(part), self.world_size), *trailing)
            out[index] = part
        return out.to(t.device)

    def agree(self, decision: bool) -> bool:
        """Rank 0's `decision`, on every rank: control flow never diverges."""
        if not self.active:
            return decision
        flag = torch.tensor([1 if decision else 0], device=self.device)
        dist.broadcast(flag, src=self.root, group=self.group)
        return bool(flag.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable), on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group, device=self.device)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

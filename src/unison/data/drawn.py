"""Each epoch's order drawn as the user's own `DataLoader` draws it: from its `generator` (or its
sampler's), else from the global generator, as `RandomSampler` does. A one-process loop on
`unison.Run` then trains on the very batches of the plain loop it replaced, and W processes deal
that same global order.

The generators' states are taken once (`DrawnOrder(dl)`, when the loop hands the loader over) and
each epoch is replayed from them on copies: per epoch the `DataLoader` draws its worker base seed
from its generator, then the sampler draws its order. The user's generators are never advanced, and
the states are what a checkpoint keeps (`state_dict`), so a resume, at any W, draws the same orders.

With no generator the global one is replayed from its state at hand-over: equal to the plain loop's
order in every epoch when nothing else in the loop draws from the global generator (no dropout, no
random augmentation); else equal in the first epoch, and still one order for every W.

>>> dl = DataLoader(range(6), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
>>> drawn = DrawnOrder(dl)
>>> [[int(i) for b in dl for i in b] for epoch in range(2)]   # the plain loop's two epochs
[[5, 1, 0, 3, 2, 4], [4, 2, 1, 3, 0, 5]]
>>> drawn.order(dl.sampler, epoch=1)          # its second epoch, drawn again
tensor([4, 2, 1, 3, 0, 5])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from unison.data.permutation import draw_key
from unison.data.plan import Order, draw_order

__all__ = ["DrawnOrder"]

_SAME = "same"  # the sampler draws from the loader's own generator (DataLoader(shuffle=True, generator=g))


def _copy(state: Tensor | None) -> torch.Generator | None:
    if state is None:
        return None
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _states(
    loader_gen: torch.Generator | None, sampler_gen: torch.Generator | None, same: bool
) -> dict[str, Any]:
    """Where the loader's, the sampler's (`same`: the loader's own) and the global generator stand."""
    return {
        "loader": loader_gen.get_state() if loader_gen is not None else None,
        "sampler": _SAME if same else (sampler_gen.get_state() if sampler_gen is not None else None),
        "global": torch.get_rng_state(),
    }


class DrawnOrder:
    """The orders of a `DataLoader`'s epochs as the loader itself would draw them (module docstring)."""

    def __init__(self, dl: DataLoader) -> None:
        loader_gen = dl.generator
        sampler = dl.batch_sampler if dl.batch_size is None else dl.sampler
        sampler_gen = getattr(sampler, "generator", None)
        same = sampler_gen is not None and sampler_gen is loader_gen  # DataLoader(shuffle=True, generator=g)
        self._start = _states(loader_gen, sampler_gen, same)
        self._starts: list[dict[str, Any]] = [self._start]  # the states at the start of epoch k
        self._last: tuple[int, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The generators' states at hand-over: every epoch's order follows from them."""
        return dict(self._start)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = dict(state)
        self._starts, self._last = [self._start], None

    def order(self, sampler: Any, epoch: int, scalable: bool = False) -> Order:
        """What `sampler` (the loader's sampler, or its batch sampler) yields in `epoch`."""
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        # From the latest epoch start known, up to `epoch`: each start kept (the next one follows from it).
        for k in range(min(epoch, len(self._starts) - 1), epoch + 1):
            order, after = self._draw(sampler, self._starts[k], k, scalable)
            if k + 1 == len(self._starts):
                self._starts.append(after)
        self._last = (epoch, order)
        return order

    @staticmethod
    def _draw(sampler: Any, state: dict[str, Any], epoch: int, scalable: bool) -> tuple[Any, dict[str, Any]]:
        """One epoch from `state`: (its order, the states after it)."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state["global"])
            loader_gen = _copy(state["loader"])
            same = state["sampler"] == _SAME
            own = loader_gen if same else _copy(state["sampler"])
            draw_key(loader_gen)  # DataLoader.__iter__: the workers' base seed, from the loader's generator
            order = draw_order(sampler, own, epoch, scalable, run_to_end=True)
            return order, _states(loader_gen, own, same)

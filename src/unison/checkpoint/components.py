"""The objects a checkpoint (and a torchft heal) is handed besides model and optimizer: anything with
`state_dict` / `load_state_dict` that the loop steps (an LR scheduler, an EMA of the weights, a
step counter), each under a stable name, restored after the optimizer without touching the
optimizer's hyper-parameters.

    components = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}
    Checkpoint(every=100, components=components)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from unison.checkpoint.errors import CheckpointError

__all__ = ["Group", "check_components", "kept_hyperparameters", "stateful_problem"]


def stateful_problem(obj: Any) -> str | None:
    """Why `obj` cannot be checkpointed (one line), or None when it has `state_dict` and `load_state_dict`."""
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        return f"a {type(obj).__name__} has no {' or '.join(missing)}: it cannot be checkpointed"
    return None


@contextlib.contextmanager
def kept_hyperparameters(opt: torch.optim.Optimizer | None) -> Iterator[None]:
    """Every param group's hyper-parameters (LR, momentum, betas, a scheduler's `initial_lr`, ...) as
    they were before the block: a torch scheduler built or loaded on a restored optimizer may write
    its own values into it, and a resume continues from the restored ones.

    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.5, momentum=0.9)
    >>> with kept_hyperparameters(opt):
    ...     sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    >>> opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]   # not OneCycleLR's 0.004, 0.95
    (0.5, 0.9)
    """
    groups = opt.param_groups if opt is not None else []
    kept = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    try:
        yield
    finally:
        for group, values in zip(groups, kept, strict=True):
            group.update(values)


def check_components(components: Mapping[str, Any], states: Mapping[str, Any], source: Any) -> None:
    """Refuse, in one line, a checkpoint whose components are not those handed now: one left at
    its start, or a saved one dropped, would resume silently off the uninterrupted run."""
    missing = sorted(set(components) - set(states))
    unexpected = sorted(set(states) - set(components))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} holds the components {sorted(states)}, this run hands {sorted(components)}: "
            "resume with the same objects (a scheduler given to run.setup, registered state) as the "
            "interrupted run"
        )


class Group:
    """Named objects with `state_dict` / `load_state_dict` kept as one: their states by name (with
    `skip_empty`, only those that have one: callbacks without state), loaded into the objects
    whose name was saved, `keep`'s hyper-parameters as they were (a scheduler loaded writes them).

    >>> counter = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), 10)
    >>> Group({"sched": counter}).state_dict()["sched"]["step_size"]
    10
    """

    def __init__(
        self, objects: Mapping[str, Any], keep: torch.optim.Optimizer | None = None, skip_empty: bool = False
    ):
        self.objects, self.keep, self.skip_empty = objects, keep, skip_empty

    def state_dict(self) -> dict[str, Any]:
        states = {name: obj.state_dict() for name, obj in self.objects.items()}
        return {name: state for name, state in states.items() if state or not self.skip_empty}

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        with kept_hyperparameters(self.keep):
            for name, obj in self.objects.items():
                if name in states:
                    obj.load_state_dict(states[name])

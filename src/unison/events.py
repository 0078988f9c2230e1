"""The callback protocol: named events, an `order`, and the cancel exceptions.

A callback is a small object with methods named after the events it handles.
The learner calls each event on every callback, sorted by `order` (lower first).
Callbacks read and change the learner's state through `self.learn`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from unison.learner_view import EngineHost, LearnerView

# The events, in the order a fit raises them (the batch and phase events repeat).
EVENTS: tuple[str, ...] = (
    "before_fit",
    "before_epoch",
    "before_train",
    "before_batch",
    "after_pred",
    "after_loss",
    "before_backward",
    "before_redo",  # only under torchft, where a step's vote failed: its forward pass comes again
    "after_backward",
    "before_step",
    "after_step",
    "after_cancel_batch",
    "after_batch",
    "after_cancel_train",
    "after_train",
    "before_validate",
    "after_cancel_validate",
    "after_validate",
    "after_cancel_epoch",
    "after_epoch",
    "after_cancel_fit",
    "after_fit",
)


class CancelFitException(Exception):
    """Raise in a callback to stop fitting; `after_cancel_fit` then `after_fit` run."""


class CancelEpochException(Exception):
    """Raise to skip the rest of this epoch; `after_cancel_epoch` then `after_epoch` run."""


class CancelTrainException(Exception):
    """Raise to skip the rest of this epoch's training phase (validation still runs)."""


class CancelValidException(Exception):
    """Raise to skip the rest of this epoch's validation phase."""


class CancelBatchException(Exception):
    """Raise to skip the rest of this batch (e.g. its optimizer step); `after_batch` still runs."""


class Callback:
    """Base class: override the events you need; lower `order` runs first.

    >>> class PrintLoss(Callback):
    ...     def after_batch(self):
    ...         if self.learn.training:
    ...             print(float(self.learn.loss))
    """

    order: int = 0
    learn: LearnerView

    @property
    def name(self) -> str:
        """snake_case of the class name, minus a trailing `Callback`: the attribute on the learner."""
        cls = type(self).__name__
        if cls.endswith("Callback") and cls != "Callback":
            cls = cls[: -len("Callback")]
        out = []
        for i, ch in enumerate(cls):
            if ch.isupper() and i and not cls[i - 1].isupper():
                out.append("_")
            out.append(ch.lower())
        return "".join(out)

    def state_dict(self) -> dict[str, Any]:
        """State a resumable checkpoint must keep (tensors and plain Python values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(order={self.order})"


def attach_callback(host: EngineHost, cb: Callback | type[Callback]) -> Callback:
    """Attach `cb` (an instance, or a class to instantiate with no arguments) to `host`'s callbacks,
    kept sorted by `order`: what `Learner.add_cb` and the own-loop `Run` do.

        cb = attach_callback(learn, EarlyStopping)
    """
    if isinstance(cb, type):
        cb = cb()
    if not isinstance(cb, Callback):
        raise TypeError(f"add_cb: {cb!r} is not a unison Callback")
    # (a callback on the Learner sees it whole; one on Run's host uses only the engine's view)
    cb.learn = cast("LearnerView", host)
    host.cbs.append(cb)
    host.cbs.sort(key=lambda c: c.order)
    return cb


def fire(cbs: list[Callback], event: str) -> None:
    """Call `event` on every callback of `cbs` that handles it, in order (a copy: one may detach)."""
    for cb in list(cbs):
        handler = getattr(cb, event, None)
        if handler is not None:
            handler()


def detach_callback(host: EngineHost, cb: Callback | type[Callback]) -> None:
    """Detach a callback instance, or every callback of a class, from `host`."""
    if isinstance(cb, type):
        host.cbs = [c for c in host.cbs if not isinstance(c, cb)]
    elif cb in host.cbs:
        host.cbs.remove(cb)


@contextlib.contextmanager
def attached_callbacks(host: LearnerView, cbs: Iterable[Callback | type[Callback]]) -> Iterator[None]:
    """Callbacks attached to `host` for the duration of a `with` block."""
    added = [attach_callback(host, cb) for cb in cbs]
    try:
        yield
    finally:
        for cb in added:
            detach_callback(host, cb)

"""torch's c10d rendezvous with a deadline on every store call (`unison-c10d`).

torch's agent calls its rendezvous store while the workers run (how many nodes wait to join) and
when it ends (closing the rendezvous). The c10d backend's `read_timeout` is meant to bound those
calls, but a store client blocks for as long as the link to the store's machine is cut: with the
link between two machines down, the machine that does not host the store ended only when the link
came back (a 300 s cut: 334 s), its agent caught in `C10dRendezvousBackend._call_store`. Here each
call ends within `read_timeout` seconds, failing as torch's own connection errors do.

Imported when a launch starts (it loads torch), not when options are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler

from unison.distributed.deadline import within
from unison.launch.rendezvous import BOUNDED_C10D

#: torch's default bound on a c10d rendezvous store read (its `read_timeout`).
DEFAULT_READ_TIMEOUT_S = 60


class BoundedBackend(RendezvousBackend):
    """A rendezvous backend whose every state read and write ends within `limit_s` seconds.

    For example:

        backend, store = create_backend(params)
        create_handler(store, BoundedBackend(backend, 60, "10.0.0.1:29400"), params)
    """

    def __init__(self, inner: RendezvousBackend, limit_s: float, endpoint: str):
        self._inner, self._limit_s, self._endpoint = inner, limit_s, endpoint

    @property
    def name(self) -> str:
        return BOUNDED_C10D  # what torch's handler checks against the configured backend name

    def _bounded(self, call: Callable[[], Any]) -> Any:
        try:
            return within(self._limit_s, call, f"the rendezvous store at {self._endpoint}")
        except TimeoutError as exc:
            raise RendezvousConnectionError(f"{exc} (its read_timeout)") from None

    def get_state(self) -> Any:
        return self._bounded(self._inner.get_state)

    def set_state(self, state: bytes, token: Any = None) -> Any:
        return self._bounded(lambda: self._inner.set_state(state, token))


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    backend, store = create_backend(params)
    limit = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S) or DEFAULT_READ_TIMEOUT_S
    return create_handler(store, BoundedBackend(backend, limit, params.endpoint), params)


def register_bounded_c10d() -> str:
    """Register the bounded c10d rendezvous in torch's registry (once); return its name.

    For example:

        LaunchConfig(..., rdzv_backend=register_bounded_c10d())
    """
    rendezvous_handler_registry.register(BOUNDED_C10D, _create_handler)
    return BOUNDED_C10D

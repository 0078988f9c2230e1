"""What the launcher works around in torch (2.11 to 2.13): each shim, its torch issue, and what lets it go.

Here:

- `launch_config` / `TAKES_SHUTDOWN_TIMEOUT`: torch 2.13's `LaunchConfig` takes `shutdown_timeout`
  (how long a worker told to stop by SIGTERM gets before SIGKILL); 2.11's has no such field and
  always waits its own 30 s. unison passes the grace it wants where torch takes it, and refuses
  `--shutdown-timeout` in one line where torch cannot honour it. Goes when unison needs torch >= 2.13.
- `StorePortHold`: torch's agent picks the workers' MASTER_PORT by binding port 0 and closing it,
  and rank 0 binds it only when the workers start, so another process can take it in between (an
  attempt lost to `[Errno 98] Address already in use`). Goes when torch's agent keeps the port it
  picks bound until the workers' store has it.
- `register_bounded_c10d` (the `unison-c10d` rendezvous backend): c10d's `read_timeout` does not
  bound a store call across a cut link (the agent waits until the link returns). Goes when torch's
  store client honours its timeout there.

Elsewhere, where torch's code they wrap lives (each module says why in full):

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (`launcher.plan_launch`): a restarted worker must not read
  the previous attempt's keys from a rendezvous store that outlives it (pytorch/pytorch#135712).
  Goes when torch's shared store keys its workers' entries by attempt.
- `group_keeper` and `worker.end_process`: a gloo group freed while DDP's backward state holds it
  deadlocks on the GIL (pytorch/pytorch#56297), and interpreter finalization aborts a worker
  whose threads still run (pytorch/pytorch#179291). Go when those issues are fixed in every torch
  unison supports.

>>> launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=10).nproc_per_node
2
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler
from torch.distributed.launcher.api import LaunchConfig

from unison.distributed.deadline import within
from unison.launch.options import LaunchError

#: Whether this torch's agent takes a SIGTERM grace (`LaunchConfig.shutdown_timeout`, torch >= 2.13).
TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def launch_config(*, user_grace: bool = False, **fields: Any) -> LaunchConfig:
    """torch's `LaunchConfig(**fields)`, less a `shutdown_timeout` this torch has no field for.

    `user_grace`: the user asked for the grace (`--shutdown-timeout`): refused on such a torch.
    """
    if "shutdown_timeout" in fields and not TAKES_SHUTDOWN_TIMEOUT:
        if user_grace:
            raise LaunchError(
                f"--shutdown-timeout needs torch >= 2.13 (this is {torch.__version__}, whose agent "
                "always gives a stopping worker 30 s)"
            )
        del fields["shutdown_timeout"]
    return LaunchConfig(**fields)


def shutdown_grace(config: LaunchConfig) -> float | None:
    """The SIGTERM grace `config` gives (None: torch's own default)."""
    return getattr(config, "shutdown_timeout", None)


class StorePortHold:
    """Choose each attempt's MASTER_PORT here and keep it bound until the next attempt.

    torch's agent picks a free port for the workers' store and closes it; rank 0 binds it seconds
    later (the workers' start), and on a busy machine another process (any connect() or bind)
    can take it in between: rank 0 fails with `[Errno 98] Address already in use` and an attempt
    is lost. Where this node's workers are the whole world, the port is chosen here instead and
    held by a socket that is bound but never listens, with SO_REUSEADDR: no other program can
    bind it or get it from the kernel, while rank 0's store (which sets SO_REUSEADDR too, as
    TCPStore does) binds it and listens. Across machines the port torch agreed is left as is.

    >>> hold = StorePortHold()
    >>> envs = {0: {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    ...         1: {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}}
    >>> hold.assign(envs)
    >>> envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == str(hold.port)
    True
    >>> hold.release()
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    @property
    def port(self) -> int | None:
        """The port held now, or None."""
        return self._sock.getsockname()[1] if self._sock is not None else None

    def assign(self, envs: dict[int, dict[str, str]]) -> None:
        """Give the workers of one attempt (`envs`: local rank -> environment) a held store port."""
        self.release()
        first = next(iter(envs.values()), None)
        if first is None or first.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return  # the agent's own store serves the workers: its port is not ours to change
        if first.get("WORLD_SIZE") != str(len(envs)) or "MASTER_PORT" not in first:
            return  # ranks on other machines read the port torch's rendezvous agreed
        v6 = ":" in first.get("MASTER_ADDR", "")
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if v6 else "", 0))  # every address: rank 0 may bind loopback or all of them
        self._sock = sock
        for env in envs.values():
            env["MASTER_PORT"] = str(self.port)

    def release(self) -> None:
        """Let the held port go (the attempt it was for is over)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# ---- the bounded c10d rendezvous ----------------------------------------------------------------
# torch's c10d rendezvous with a deadline on every store call (`unison-c10d`).
#
# torch's agent calls its rendezvous store while the workers run (how many nodes wait to join) and
# when it ends (closing the rendezvous). The c10d backend's `read_timeout` is meant to bound those
# calls, but a store client blocks for as long as the link to the store's machine is cut: with the
# link between two machines down, the machine that does not host the store ended only when the link
# came back (a 300 s cut: 334 s), its agent caught in `C10dRendezvousBackend._call_store`. Here each
# call ends within `read_timeout` seconds, failing as torch's own connection errors do.

#: torch's c10d rendezvous with a deadline on every store call, by the name it is registered under.
BOUNDED_C10D = "unison-c10d"
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

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

Elsewhere, where torch's code they wrap lives (each module says why in full):

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (`launcher.plan_launch`): a restarted worker must not read
  the previous attempt's keys from a rendezvous store that outlives it (pytorch/pytorch#135712).
  Goes when torch's shared store keys its workers' entries by attempt.
- `bounded_rendezvous`: c10d's `read_timeout` does not bound a store call across a cut link (the
  agent waits until the link returns). Goes when torch's store client honours its timeout there.
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
from typing import Any

import torch
from torch.distributed.launcher.api import LaunchConfig

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

"""The launcher's side of the torch releases unison runs on (2.11 to 2.13): one place, each shim named.

torch 2.13's `LaunchConfig` takes `shutdown_timeout` (how long a worker told to stop by SIGTERM gets
before SIGKILL); 2.11's has no such field and always waits its own 30 s. unison passes the grace it
wants where torch takes it, and refuses `--shutdown-timeout` in one line where torch cannot honour it.

>>> launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=10).nproc_per_node
2
"""

from __future__ import annotations

import dataclasses
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

"""The launcher's own process environment: variables exported for torch's agent, its log level."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """Export `env` for the duration of the block (torch's agent passes os.environ to workers)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet_torch_logs(verbose: bool) -> None:
    """torch's agent logs every step at WARNING/ERROR; the summary says what matters."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if verbose else logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        if verbose:
            logger.setLevel(logging.INFO)

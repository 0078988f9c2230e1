"""What a fault-tolerant replica's log says: `quiet_torchft` (how much of torchft's own logging shows)
and `start_line` (its first event).

By default a replica's log holds unison's one-line events (started, left, redone, joined,
healed) and torchft's warnings. torchft's Rust side logs about four INFO lines per step (its
quorums and commit votes), and its Python `Manager` logs an error *with a traceback* when a
collective fails on a lost peer (gloo's "Connection closed by peer"), which unison then handles
by redoing the step. Those are kept for when they help: `verbose=True`
(`distrib_ctx(fault_tolerant={"verbose": True})`), `UNISON_FT_VERBOSE=1`, or `unison launch -v`.

    quiet_torchft(verbose=False)   # before torchft starts: RUST_LOG=warn, tracebacks folded to one line
"""

from __future__ import annotations

import logging
import os
import warnings

from unison.env_names import FT_VERBOSE_ENV as VERBOSE_ENV

__all__ = ["VERBOSE_ENV", "quiet_torchft", "start_line"]


def quiet_torchft(verbose: bool | None = None) -> bool:
    """Unless `verbose` (default: `UNISON_FT_VERBOSE`), keep torchft's INFO lines and tracebacks out
    of the log. Call before torchft's Manager starts (its Rust logger reads `RUST_LOG` then); a
    `RUST_LOG` the user set is kept. Returns whether torchft stays verbose."""
    if verbose is None:
        verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    if verbose:
        return True
    os.environ.setdefault("RUST_LOG", "warn")
    # torch's warning when torchft's checkpoint transport rebuilds a received state (once, harmless)
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _OneLine) for f in logger.filters):
        logger.addFilter(_OneLine())
    return False


def start_line(
    position: tuple[int, int], healed: tuple[int, int] | None, replicas: list[str], source: str | None
) -> str:
    """A replica's first line: where it starts and with whom. `healed`: the position torchft gave it
    from replica `source` (None: none); a heal to a later position than its own is a recovery.

    >>> start_line((0, 0), (0, 0), ["a", "b"], "a")[:64]
    "started with replicas a, b at epoch 0 step 0; took replica a's w"
    """
    epoch, step = healed or position
    if healed is not None and healed != position:  # behind its peers: a recovery
        source = f" (replica {source})" if source else ""
        return f"healed from a live peer{source}: joins at epoch {epoch} step {step}"
    line = f"started with replicas {', '.join(sorted(set(replicas)))} at epoch {epoch} step {step}"
    if healed is not None:  # at its peers' position already: they started together
        line += f"; took replica {source or '?'}'s weights and optimizer state, so all start identical"
    return line


class _OneLine(logging.Filter):
    """An error logged with a traceback becomes one line: the message and the exception's first line
    (and torchft's note about NCCL's flight recorder, which it gives at every start, is dropped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "NCCL flight recorder" in record.getMessage():  # said at every start, about NCCL, on gloo too
            return False
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            said = (record.getMessage().strip().splitlines() or [""])[0]
            first = (str(exc).strip().splitlines() or [""])[0]
            if first and first[:80] not in said:  # (torchft's message often quotes the error already)
                said += f" ({type(exc).__name__}: {first})"
            said = said if len(said) <= 300 else said[:297] + "..."
            record.msg = f"{said} [{VERBOSE_ENV}=1 shows the traceback]"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True

"""One writer for a fastai `Learner`'s files on W processes, and a log that a resumed fit leaves as
the uninterrupted one wrote it:

- `together`: a save, load or export that runs on every rank (fastai writes on rank 0 alone), after
  which every rank knows how every other did: the file is whole before any rank reads it, and one
  rank's error is raised on every rank, naming it;
- `plain_learner`: the learner as one fastai process holds it, for `learn.export` to pickle;
- `silence_loggers`: fastai's logging callbacks run on rank 0 alone (each row written once);
- `csv_starts` / `rewind_csv_logs`: where each CSVLogger's file began, and a resumed fit's file cut
  back there (the finished epochs' rows are logged again as they pass).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unison.distributed.collective import Collective
from unison.distributed.sync_bn import revert_sync_batchnorm
from unison.fastai.state import user_callbacks

__all__ = ["csv_starts", "plain_learner", "rewind_csv_logs", "silence_loggers", "together"]

#: fastai's callbacks that write logs or files: rank 0's alone run (one writer, each row once).
RANK0_LOGGERS = frozenset(
    {
        "CSVLogger",
        "TensorBoardCallback",
        "TensorBoardProjectorCallback",
        "WandbCallback",
        "CometCallback",
        "NeptuneCallback",
        "AzureMLCallback",
        "ShowGraphCallback",
    }
)


def together(collective: Collective, what: str, work: Callable[[], Any]) -> Any:
    """`work()` on this rank, then every rank's outcome on every rank (see the module's docstring)."""
    error: BaseException | None = None
    try:
        result = work()
    except Exception as exc:
        error, result = exc, None
    mine = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(r, e) for r, e in enumerate(collective.gather_objects(mine)) if e is not None]
    if error is not None:
        raise error
    if failed:
        rank, reason = failed[0]
        raise RuntimeError(f"unison.fastai: {what} failed on rank {rank}: {reason}")
    return result


@contextlib.contextmanager
def plain_learner(learn: Any, raw_model: Any) -> Iterator[None]:
    """`learn` with a copy of `raw_model` unwrapped with plain BatchNorm and without unison's
    callbacks, inside the block; as it was after it."""
    model, opt = learn.model, learn.opt  # (fastai's export makes an optimizer anew: this one stays)
    unisons = [cb for cb in learn.cbs if type(cb).__module__.startswith("unison.")]
    learn.model = revert_sync_batchnorm(copy.deepcopy(raw_model))
    learn.remove_cbs(unisons)
    try:
        yield
    finally:
        learn.model, learn.opt = model, opt
        learn.add_cbs(unisons)


def silence_loggers(learn: Any) -> None:
    """fastai's logging callbacks off for this fit (rank > 0; fastai sets `run` again after it)."""
    for cb in learn.cbs:
        if type(cb).__name__ in RANK0_LOGGERS:
            cb.run = False


def csv_starts(learn: Any) -> dict[str, int]:
    """Each CSVLogger's file size before its fit opens it (0 where it writes the file anew)."""
    starts = {}
    for key, cb in user_callbacks(learn):
        if type(cb).__name__ == "CSVLogger":
            file = Path(learn.path) / cb.fname
            starts[key] = file.stat().st_size if cb.append and file.exists() else 0
    return starts


def rewind_csv_logs(learn: Any, starts: dict[str, int]) -> None:
    """Each CSVLogger's open file cut back to `starts`, its header written again."""
    for key, cb in user_callbacks(learn):
        file = getattr(cb, "file", None)
        if key in starts and file is not None and not file.closed:
            file.truncate(starts[key])
            file.write(",".join(learn.recorder.metric_names) + "\n")

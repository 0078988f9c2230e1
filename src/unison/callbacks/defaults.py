"""The callbacks every `Learner` has unless `default_cbs=False`, assembled in this one place.

- `Recorder`: losses, metrics and the printed table (the learner keeps it as `learn.recorder`);
- `ProgressCallback`: the progress bars, on rank 0;
- `NonFiniteCheck(on_nonfinite)`: the first non-finite loss or gradient on any rank stops every
  rank at that step (or skips it); left out when `on_nonfinite=None`;
- `Preemption`: a preemption signal (SIGTERM, SIGUSR1, ...) stops every rank at one step boundary,
  checkpointed, with exit status 75 (`on_preempt="requeue"` also requeues a SLURM job); left out
  when `on_preempt=None`.

>>> [type(cb).__name__ for cb in default_callbacks(Recorder(), "stop", "stop")]
['Recorder', 'ProgressCallback', 'NonFiniteCheck', 'Preemption']
"""

from __future__ import annotations

from typing import get_args

from unison.callbacks.nonfinite import Mode, NonFiniteCheck
from unison.callbacks.preemption import OnPreempt, Preemption
from unison.callbacks.progress import ProgressCallback
from unison.callbacks.recorder import Recorder
from unison.events import Callback


def default_callbacks(
    recorder: Recorder, on_nonfinite: Mode | None, on_preempt: OnPreempt | None = "stop"
) -> list[Callback]:
    """The default callbacks of a learner whose recorder is `recorder`."""
    check = [NonFiniteCheck(on_nonfinite)] if on_nonfinite is not None else []
    if on_preempt is not None and on_preempt not in get_args(OnPreempt):
        raise ValueError(f"on_preempt must be 'stop', 'requeue' or None, got {on_preempt!r}")
    # "stop" leaves the requeue to UNISON_REQUEUE (a batch script can ask without editing the code)
    preempt = [Preemption(requeue=True if on_preempt == "requeue" else None)] if on_preempt else []
    return [recorder, ProgressCallback(), *check, *preempt]

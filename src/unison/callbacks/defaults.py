"""The callbacks every `Learner` has unless `default_cbs=False`, assembled in this one place.

- `Recorder`: losses, metrics and the printed table (the learner keeps it as `learn.recorder`);
- `ProgressCallback`: the progress bars, on rank 0;
- `NonFiniteCheck(on_nonfinite)`: the first non-finite loss or gradient on any rank stops every
  rank at that step (or skips it); left out when `on_nonfinite=None`.

>>> [type(cb).__name__ for cb in default_callbacks(Recorder(), "stop")]
['Recorder', 'ProgressCallback', 'NonFiniteCheck']
"""

from __future__ import annotations

from unison.callbacks.core import Callback
from unison.callbacks.nonfinite import Mode, NonFiniteCheck
from unison.callbacks.progress import ProgressCallback
from unison.callbacks.recorder import Recorder


def default_callbacks(recorder: Recorder, on_nonfinite: Mode | None) -> list[Callback]:
    """The default callbacks of a learner whose recorder is `recorder`."""
    check = [NonFiniteCheck(on_nonfinite)] if on_nonfinite is not None else []
    return [recorder, ProgressCallback(), *check]

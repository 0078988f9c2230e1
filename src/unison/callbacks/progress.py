"""`ProgressCallback`: tqdm bars for epochs and batches, on rank 0 only."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from unison.callbacks.core import Callback
from unison.data.stream import loader_length


class ProgressCallback(Callback):
    """An epoch bar and a batch bar showing the running loss.

    `show=None` shows bars only when stderr is a terminal (logs stay clean);
    `True` forces them, `False` hides them. Other ranks never show bars.

    >>> learn = Learner(dls, model, loss_func, cbs=[])   # default: ProgressCallback(show=None)
    """

    order = 60

    def __init__(self, show: bool | None = None, refresh_s: float = 0.2):
        self.show = show
        self.refresh_s = refresh_s
        self.active = False
        self._epoch_bar: tqdm | None = None
        self._bar: tqdm | None = None

    def _enabled(self) -> bool:
        if not self.learn.collective.is_main:
            return False
        return sys.stderr.isatty() if self.show is None else self.show

    def before_fit(self) -> None:
        self.active = self._enabled()
        if self.active:
            self._epoch_bar = tqdm(
                total=self.learn.n_epoch,
                initial=self.learn.start_epoch,
                desc="epoch",
                leave=True,
                dynamic_ncols=True,
            )

    def _open(self, desc: str) -> None:
        if self._enabled():
            self.active = True
            self._bar = tqdm(total=loader_length(self.learn.dl), desc=desc, leave=False, dynamic_ncols=True)
            self._last = 0.0

    def before_train(self) -> None:
        self._open("train")

    def before_validate(self) -> None:
        self._open("valid")

    def after_batch(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.perf_counter()
        if self.learn.training and self.learn.loss is not None and now - self._last > self.refresh_s:
            self._last = now  # the loss read is a host sync: not on every batch
            self._bar.set_postfix(loss=f"{float(self.learn.loss):.4f}", refresh=False)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def after_train(self) -> None:
        self._close()

    def after_validate(self) -> None:
        self._close()
        if self._epoch_bar is None:
            self.active = False

    def after_epoch(self) -> None:
        if self._epoch_bar is not None:
            self._epoch_bar.update(1)

    def after_fit(self) -> None:
        self._close()
        if self._epoch_bar is not None:
            self._epoch_bar.close()
            self._epoch_bar = None
        self.active = False

    def write(self, line: str) -> None:
        tqdm.write(line, file=sys.stdout)

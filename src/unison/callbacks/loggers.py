"""Loggers: one row per epoch to a CSV file, or scalars to TensorBoard; rank 0 writes.

Both read what the `Recorder` reduced over all ranks, so a log is the same on one
process and on W (the per-batch losses are the global batch's).
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from typing import Any

from unison.events import Callback


def optional_import(module: str, who: str, extra: str, package: str | None = None) -> Any:
    """`module`, imported when `who` needs it; if it is missing, an error naming the pip line that
    installs `package` (default: `extra`, unison's extra of that name)."""
    package = package or extra
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"{who} needs {package}: pip install 'unison[{extra}]' (or pip install {package})"
        ) from None


class CSVLogger(Callback):
    """Append `epoch, train_loss, valid_loss, *metrics, time` to `path/fname` after every epoch.

    For example:

        learn.fit(3, cbs=[CSVLogger("history.csv")])
        learn.csv_logger.read()[-1]["valid_loss"]
    """

    order = 60  # after the Recorder has this epoch's values

    def __init__(self, fname: str | Path = "history.csv", append: bool = False):
        self.fname, self.append = Path(fname), append

    @property
    def file(self) -> Path:
        return self.fname if self.fname.is_absolute() else self.learn.path / self.fname

    def before_fit(self) -> None:
        setattr(self.learn, "csv_logger", self)  # noqa: B010 (an attribute the learner does not declare)
        if not self.learn.collective.is_main:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.append or not self.file.exists()
        if fresh:
            with open(self.file, "w", newline="") as f:
                csv.writer(f).writerow(self.learn.recorder.metric_names)

    def after_epoch(self) -> None:
        recorder = self.learn.recorder
        if not self.learn.collective.is_main or not recorder.values:
            return
        row = [self.learn.epoch, *recorder.values[-1], f"{recorder.times[-1]:.3f}"]
        with open(self.file, "a", newline="") as f:
            csv.writer(f).writerow(row)

    def read(self) -> list[dict[str, str]]:
        """The rows written so far, as dicts keyed by column name."""
        with open(self.file, newline="") as f:
            return list(csv.DictReader(f))


class TensorBoardLogger(Callback):
    """Write each batch's (global) training loss and LR, and each epoch's values, to TensorBoard.

    Needs the `tensorboard` package (`pip install 'unison[tensorboard]'`).

        learn.fit(3, cbs=[TensorBoardLogger("runs/exp1")])
    """

    order = 60

    def __init__(self, log_dir: str | Path = "runs"):
        self.log_dir = Path(log_dir)
        self.writer: Any = None

    def before_fit(self) -> None:
        if not self.learn.collective.is_main:
            return
        tensorboard = optional_import("torch.utils.tensorboard", "TensorBoardLogger", "tensorboard")
        log_dir = self.log_dir if self.log_dir.is_absolute() else self.learn.path / self.log_dir
        self.writer = tensorboard.SummaryWriter(log_dir=str(log_dir))
        self._logged = len(self.learn.recorder.losses)

    def after_epoch(self) -> None:
        if self.writer is None:
            return
        recorder = self.learn.recorder
        for step in range(self._logged, len(recorder.losses)):
            self.writer.add_scalar("train/batch_loss", recorder.losses[step], step)
            if step < len(recorder.lrs):
                self.writer.add_scalar("train/lr", recorder.lrs[step], step)
        self._logged = len(recorder.losses)
        if recorder.values:
            for name, value in recorder.last_values().items():
                self.writer.add_scalar(f"epoch/{name}", value, self.learn.epoch)
        self.writer.flush()

    def after_fit(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

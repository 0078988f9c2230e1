"""`Recorder`: per-batch losses and LRs, per-epoch values, the printed table and the loss plot."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from unison.callbacks.loggers import optional_import
from unison.events import Callback
from unison.metrics import WeightedMean, update_metric


def format_time(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Recorder(Callback):
    """Records the training run; prints one table row per epoch on rank 0.

    `values` holds `[train_loss, valid_loss, *metrics]` per epoch, `metric_names`
    the column names, `losses` and `lrs` the per-batch training loss and LR. Each
    per-batch loss is the global batch's (every rank's loss terms together), so the
    curve is the same on one process and on W.

        learn.recorder.values[-1]        # last epoch
        learn.recorder.plot_loss("loss.png")
    """

    order = 50

    def __init__(self, print_table: bool = True, write: Callable[[str], None] | None = None):
        self.print_table = print_table
        self.write = write
        self.values: list[list[float]] = []
        self.times: list[float] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.last_valid: list[float] = []
        self.paused = False
        # This epoch's training losses and batch sizes, kept as they come (no tensor math per
        # batch) and reduced once in after_train; `_carry` holds sums resumed from another layout.
        self._batch_losses: list[torch.Tensor] = []
        self._batch_sizes: list[float] = []
        self._n_resumed = 0
        self._resumed_means: list[float] = []  # the global losses of the batches resumed mid-epoch
        self._carry = torch.zeros(2)  # (sum of loss x batch size, sum of batch sizes)
        self._header_done = False
        self._pending_partial: dict[str, Any] | None = None
        # Which phases our `before_*` opened: a callback of lower order may cancel a phase
        # before we saw it begin, and its `after_*` must not report a previous phase's values.
        self._open: set[str] = set()
        # Where the optimizer step in progress began in the lists above (losses, LRs), while one is
        # open: a step skipped at its last micro-batch leaves its earlier ones out (`forget_step`).
        self._in_step = False
        self._step_marks = (0, 0)

    @property
    def metric_names(self) -> list[str]:
        return ["epoch", "train_loss", "valid_loss", *(m.name for m in self.learn.metrics), "time"]

    def value_index(self, name: str, who: str) -> int:
        """The column of `name` in each row of `values`; `who`, the callback that monitors it, refuses
        a name that is not recorded."""
        names = self.metric_names[1:-1]  # train_loss, valid_loss, metrics: without "epoch" and "time"
        if name not in names:
            raise ValueError(f"{who} cannot monitor {name!r}, recorded values are {names}")
        return names.index(name)

    def last_values(self) -> dict[str, float]:
        """The last epoch's row of `values`, by name (`train_loss`, `valid_loss`, the metrics)."""
        return dict(zip(self.metric_names[1:-1], self.values[-1], strict=False))

    def before_fit(self) -> None:
        self._header_done = False

    def before_epoch(self) -> None:
        self._open.add("epoch")
        self._start = time.perf_counter()
        self._train_value = float("nan")
        self.last_valid = []

    def before_train(self) -> None:
        self._open.add("train")
        # resuming mid-epoch: what this rank had so far; else an epoch from its start
        partial, self._pending_partial = self._pending_partial or _empty_partial(), None
        self._resumed_means = list(partial["means"])
        self._batch_losses = list(partial["losses"])
        self._batch_sizes = [float(n) for n in partial["sizes"].tolist()]
        self._carry = partial["carry"]
        self._n_resumed = len(self._batch_losses)
        self._in_step = False

    def before_validate(self) -> None:
        self._open.add("validate")
        self._valid_loss = WeightedMean("valid_loss")
        for m in self.learn.metrics:
            m.reset()

    def before_batch(self) -> None:
        if self.learn.training and not self._in_step:  # the first batch of an optimizer step
            self._in_step = True
            self._step_marks = (len(self._batch_losses), len(self.lrs))

    def forget_step(self) -> None:
        """Leave the optimizer step in progress out of the record: the losses and LRs of the
        micro-batches it had so far (a step `NonFiniteCheck` skips at its last one)."""
        losses, lrs = self._step_marks
        del self._batch_losses[losses:], self._batch_sizes[losses:], self.lrs[lrs:]

    def after_batch(self) -> None:
        learn = self.learn
        if learn.training and learn.grad_sync:
            self._in_step = False  # this batch ended its optimizer step
        if learn.loss is None or self.paused:
            return
        n = learn.loss_count  # the loss's own terms: samples, or tokens for a SummedLoss
        if learn.training:
            self._batch_losses.append(learn.loss)  # a tensor: no host sync per batch
            self._batch_sizes.append(n)
            if learn.opt is not None:
                self.lrs.append(learn.opt.param_groups[0]["lr"])
        else:
            self._valid_loss.add(learn.loss, n)
            if learn.record_metrics and n:
                for m in learn.metrics:
                    update_metric(m, learn.pred, *learn.yb)

    def after_train(self) -> None:
        if self.paused or not self._closes("train"):
            return
        train_loss = WeightedMean("train_loss")
        train_loss.total, train_loss.count = self._train_sums()
        self.losses.extend(self._global_batch_losses())
        self._batch_losses, self._batch_sizes = [], []
        self._train_value = train_loss.value(self.learn.collective)

    def _global_batch_losses(self) -> list[float]:
        """Each batch's loss over every rank: sum of loss terms / their count (one collective).
        Batches carried over from a checkpoint take theirs from every rank's part of it."""
        fresh, sizes = self._batch_losses[self._n_resumed :], self._batch_sizes[self._n_resumed :]
        return self._resumed_means + global_means(self.learn.collective, fresh, sizes)

    def _train_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of loss x batch size, sum of batch sizes) of this rank's epoch so far.

        Always float32: they are all-reduced, and a rank whose dtype followed its own data (a
        carry resumed from another layout) would send other sizes than the rest (gloo aborts)."""
        total, count = (t.float() for t in self._carry)
        if self._batch_losses:
            losses = _stack_on_last_device(self._batch_losses)
            sizes = torch.tensor(self._batch_sizes, dtype=losses.dtype, device=losses.device)
            total = total.to(losses.device) + (losses * sizes).sum()
            count = count + sum(self._batch_sizes)
        return total, count

    def after_validate(self) -> None:
        if not self._closes("validate"):
            self.last_valid = []  # cancelled before it began: nothing was measured
            return
        if self.paused:
            return
        collective = self.learn.collective
        values = [self._valid_loss.value(collective)]
        if self.learn.record_metrics:
            values += [m.value(collective) for m in self.learn.metrics]
        self.last_valid = values

    def after_epoch(self) -> None:
        if not self._closes("epoch"):
            self.before_epoch()  # cancelled before it began: a row of NaN, not the last epoch's
            self._open.discard("epoch")
        if self.paused:
            return
        elapsed = time.perf_counter() - self._start
        row = self.epoch_values()
        self.values.append(row)
        self.times.append(elapsed)
        if self.print_table and self.learn.collective.is_main:
            self._print_row([self.learn.epoch, *row, format_time(elapsed)])

    def epoch_values(self) -> list[float]:
        """This epoch's `[train_loss, valid_loss, *metrics]` so far, reduced over every rank (NaN
        for a phase that did not run): the row `after_epoch` records."""
        valid = self.last_valid or [float("nan")] * (1 + len(self.learn.metrics))
        return [self._train_value, *valid]

    def _closes(self, phase: str) -> bool:
        """Whether `phase` was opened by our `before_*` (and mark it closed)."""
        opened = phase in self._open
        self._open.discard(phase)
        return opened

    def _print_row(self, row: list[Any]) -> None:
        names = self.metric_names
        widths = [max(len(n), 8) for n in names]
        if not self._header_done:
            self._emit("  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)))
            self._header_done = True
        cells = [f"{v:.6f}" if isinstance(v, float) else str(v) for v in row]
        self._emit("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))

    def _emit(self, line: str) -> None:
        if self.write is not None:
            self.write(line)
            return
        from unison.callbacks.progress import ProgressCallback  # (tqdm loads where a row is printed)

        progress = self.learn.get_cb(ProgressCallback)
        if progress is not None and getattr(progress, "active", False):
            progress.write(line)  # keep live bars intact
        else:
            print(line, file=sys.stdout, flush=True)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Record nothing inside the block (`lr_find` uses this)."""
        previous = self.paused
        self.paused = True
        try:
            yield
        finally:
            self.paused = previous

    def partial_state(self) -> dict[str, Any]:
        """Every rank's training losses and batch sizes of the epoch in progress (a collective)."""
        own = {
            "losses": _stack_on_last_device(self._batch_losses).cpu()
            if self._batch_losses
            else torch.zeros(0),
            "sizes": torch.tensor(self._batch_sizes, dtype=torch.float64),
            "carry": self._carry.float().cpu(),
        }
        return {"ranks": self.learn.collective.gather_objects(own)}

    def resume_partial(self, partial: dict[str, Any] | None, rank: int, world_size: int) -> None:
        """Carry `partial_state()` into the next training phase. On as many ranks as before, each
        takes its own losses (bit-exact); otherwise rank 0 keeps its own and takes the others'
        sums, so the epoch's loss reduced over ranks is the same whatever the number of processes."""
        if partial is None:
            self._pending_partial = None
            return
        ranks = partial["ranks"]
        means = _global_means(ranks)  # (the same on every rank, at any number of processes)
        if len(ranks) == world_size:
            self._pending_partial = {**ranks[rank], "means": means}
        elif rank == 0:
            carry = torch.zeros(2)
            for r in ranks[1:]:
                sums = torch.stack([(r["losses"].double() * r["sizes"]).sum(), r["sizes"].sum()])
                carry = carry + r["carry"] + sums.float()  # float32, as every other rank's carry
            self._pending_partial = {**ranks[0], "carry": ranks[0]["carry"] + carry, "means": means}
        else:
            self._pending_partial = _empty_partial(means)

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values, "times": self.times, "losses": self.losses, "lrs": self.lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = [list(v) for v in state["values"]]
        self.times = list(state["times"])
        self.losses = list(state["losses"])
        self.lrs = list(state["lrs"])

    def plot_loss(
        self, path: str | Path = "loss.png", skip_start: int = 5, with_valid: bool = True
    ) -> Path | None:
        """Write a PNG of the training loss per batch (and validation loss per epoch); rank 0 only."""
        if not self.learn.collective.is_main:
            return None
        matplotlib = optional_import("matplotlib", "plot_loss", "examples", "matplotlib")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(range(skip_start, len(self.losses)), self.losses[skip_start:], label="train")
        if with_valid and self.values:
            per_epoch = len(self.losses) / len(self.values)
            xs = [per_epoch * (i + 1) for i in range(len(self.values))]
            ax.plot(xs, [v[1] for v in self.values], marker="o", label="valid")
        ax.set_xlabel("batch")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _empty_partial(means: list[float] | None = None) -> dict[str, Any]:
    """The partial state of a rank with no batch of the epoch (`means`: the resumed batches' global
    losses, which every rank keeps)."""
    empty = {"losses": torch.zeros(0), "sizes": torch.zeros(0, dtype=torch.float64), "carry": torch.zeros(2)}
    return {**empty, "means": means or []}


def _global_means(ranks: list[dict[str, Any]]) -> list[float]:
    """The loss over every rank of each batch in the ranks' partial states, as `_global_batch_losses`
    reduces them after the batches: a resumed `recorder.losses` holds the global losses, not rank 0's own."""
    n = min(len(r["losses"]) for r in ranks)  # (none: an empty list)
    losses = torch.stack([r["losses"][:n].double() for r in ranks])
    counts = torch.stack([r["sizes"][:n].double() for r in ranks])
    return _mean_or_own((losses * counts).sum(0), counts.sum(0), losses[0]).tolist()


def global_means(collective: Any, losses: list[torch.Tensor], counts: list[float]) -> list[float]:
    """Each batch's loss over every rank: the sum of its loss terms / their count (one collective,
    which every rank joins, even one with no batch)."""
    own = torch.stack(losses).double().cpu() if losses else torch.zeros(0, dtype=torch.float64)
    sizes = torch.tensor(counts, dtype=torch.float64)
    both = collective.sum(torch.stack([own * sizes, sizes]))
    return _mean_or_own(both[0], both[1], own).tolist()


def _mean_or_own(total: torch.Tensor, count: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`total / count`, or this rank's own loss where no rank counted a term."""
    return torch.where(count > 0, total / count.clamp(min=1), own)


def _stack_on_last_device(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses as one float tensor: those resumed from a checkpoint are on the CPU, the new
    ones on the model's device (a GPU), so all go where the newest is."""
    device = losses[-1].device
    return torch.stack([loss.to(device) for loss in losses]).float()

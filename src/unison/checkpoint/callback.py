"""`Checkpoint`: resumable snapshots of a whole run, and `fit(resume=True)` behind them.

A checkpoint holds what continuing needs to land on the very weights an
uninterrupted run reaches: model, optimizer, every callback's state (recorder
included), the components it is handed (`components`: an LR scheduler, any object
with `state_dict`/`load_state_dict`), the data-order seed, the position (epoch, and
samples consumed this epoch), and the RNG states of every rank. Rank 0 writes it atomically (temp file,
fsync, rename: the previous checkpoint stays whole until the new one is), every
rank reads it with `weights_only=True`.

The position is kept in *samples*, not batches, so a run made on 2 processes at
batch b resumes on 1 process at batch 2b at the same point of the same data order.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.checkpoint.components import Group, check_components
from unison.checkpoint.errors import CheckpointError
from unison.checkpoint.store import Weights, find, load_weights, save
from unison.data.fingerprint import dataset_fingerprint
from unison.env_names import PROBE_ENV
from unison.events import Callback
from unison.loop_state import StartPoint
from unison.rng import get_rng_state, set_rng_state


def unwritable_folder(folder: Path) -> str | None:
    """Why checkpoints cannot be written into `folder` (made if missing), in one line; None if they can.

    It makes and removes a file there, as a save does (the mode bits alone do not tell: root
    ignores them, a read-only mount refuses root too).

    >>> _ = Path("notes.txt").write_text("")
    >>> print(unwritable_folder(Path("notes.txt/models")))   # a file where the folder would go
    Checkpoint: cannot write checkpoints to notes.txt/models: [Errno 20] Not a directory ...
    >>> print(unwritable_folder(Path("models")))
    None
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # made and removed at once
    except OSError as exc:
        return (
            f"Checkpoint: cannot write checkpoints to {folder}: [Errno {exc.errno}] {exc.strerror} "
            "(found before the first step; give the Learner a writable path, or make the folder writable)"
        )
    return None


class GlobalBatchChangedWarning(UserWarning):
    """A resume at another global batch (batch_size x processes) than the interrupted run's: it
    trains on, no longer equal to the uninterrupted run (an elastic job that shrank does this)."""


class Checkpoint(Callback):
    """Save a resumable checkpoint every `every` training steps and at each epoch's end.

    The file is `learn.path / learn.model_dir / f"{fname}.pth"`; `learn.fit(n, resume=True)`
    continues from it (or starts fresh when there is none). `keep_previous=True` keeps the
    checkpoint each save replaces (`checkpoint.prev.pth` / `.prev.dcp`) and resumes from it,
    with a warning, when the newest is refused. `components` (name -> object with `state_dict` /
    `load_state_dict`, read at each save) are saved too and restored after the optimizer, its
    hyper-parameters kept; `checks` run on every rank before each save (one may refuse it).
    Under `unison check-exact` the checkpoints go to a fresh folder beside the probe's record: each
    run starts from scratch, and the script's own checkpoints are left as they are.

        learn = Learner(dls, model, loss_func, cbs=[Checkpoint(every=100)])
        learn.fit(10, resume=True)     # after a crash: picks up where the last checkpoint was
    """

    order = 90  # after the recorder and trackers have settled this batch's / epoch's state

    def __init__(
        self,
        every: int | None = None,
        fname: str = "checkpoint",
        keep_previous: bool = False,
        components: dict[str, Any] | None = None,
        checks: list[Callable[[], None]] | None = None,
    ):
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"Checkpoint: every must be a positive int or None, got {every!r}")
        self.every, self.fname, self.keep_previous = every, fname, keep_previous
        self.components = components if components is not None else {}
        self.checks = checks if checks is not None else []
        self.saves = 0
        self._data_print: tuple[Any, str | None] | None = None  # (the train dataset, its fingerprint)
        #: True while a save runs: a write in progress is progress (the preemption stall rule reads it).
        self.writing = False

    @property
    def file(self) -> Path:
        # Under `unison check-exact` each run starts from scratch in a folder of its own: the script's
        # checkpoints are left as they are.
        probe = os.environ.get(PROBE_ENV)
        folder = Path(f"{probe}.checkpoints") if probe else self.learn.path / self.learn.model_dir
        return folder / f"{self.fname}.pth"

    def before_fit(self) -> None:
        """Refuse a checkpoint folder that cannot be written before the first step, on every rank.

        The ranks that write (rank 0, or every rank of a sharded model) try the folder here, not at
        the first save after training began, and every rank raises the same one-line
        `CheckpointError`, so none is left waiting in a collective.
        """
        learn = self.learn
        writes = learn.collective.is_main or learn.checkpoint_format == "dcp"
        problem = unwritable_folder(self.file.parent) if writes else None
        problems = [p for p in learn.collective.gather_objects(problem) if p is not None]
        if problems:
            raise CheckpointError(problems[0])

    def after_batch(self) -> None:
        learn = self.learn
        # Only after a real optimizer step: mid-accumulation gradients are not saved.
        if not learn.training or self.every is None or not learn.grad_sync:
            return
        if (learn.iter + 1) % self.every == 0:
            self.save(learn.epoch, learn.iter + 1)

    def after_epoch(self) -> None:
        self.save(self.learn.epoch + 1, 0)

    def _global_batch(self) -> int | None:
        """Items per global step; None for a batch sampler's loader (its position is kept in steps)."""
        learn = self.learn
        bs = learn.dls.train.batch_size
        if bs is None and getattr(learn.dls.train, "batch_sampler", None) is not None:
            return None
        if bs is None:
            raise CheckpointError("Checkpoint needs a train loader with a batch_size to record its position")
        return bs * learn.collective.world_size

    def _accumulate(self) -> int:
        """Batches per optimizer step: `Run(accumulate=k)`, or a `GradientAccumulation(k)` callback."""
        learn = self.learn
        accumulations = [cb.n_acc for cb in learn.cbs if getattr(cb, "accumulates_gradients", False)]
        return int(getattr(learn, "accumulate", None) or (accumulations[0] if accumulations else 1))

    def _train_data(self) -> tuple[int | None, str | None]:
        """The train dataset's length and fingerprint (its length and a few items, read once per
        dataset object); None where it has none (a stream)."""
        dataset = getattr(self.learn.dls.train, "dataset", None)
        try:
            items: int | None = len(dataset)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            items = None
        if self._data_print is None or self._data_print[0] is not dataset:
            self._data_print = (dataset, dataset_fingerprint(dataset))
        return items, self._data_print[1]

    def save(self, epoch: int, batches_done: int) -> Path:
        """Write the state after `batches_done` training batches of `epoch` (a collective: all ranks call)."""
        for check in self.checks:  # (every rank: a refusal leaves none waiting in the gather below)
            check()
        self.writing = True
        try:
            return self._save(epoch, batches_done)
        finally:
            self.writing = False

    def _save(self, epoch: int, batches_done: int) -> Path:
        learn, collective = self.learn, self.learn.collective
        # A stateful stream's state on every rank (each reads its own part), mid-epoch only.
        stream = learn.dl.state_dict() if batches_done and hasattr(learn.dl, "load_state_dict") else None
        ranks = collective.gather_objects((get_rng_state(), stream))
        global_batch = self._global_batch()
        state = {
            "epoch": epoch,
            "samples_done": batches_done * (global_batch or 1),
            "steps_done": batches_done,
            "global_batch": global_batch,
            "accumulate": self._accumulate(),
            **dict(zip(("train_items", "train_data"), self._train_data(), strict=True)),
            "optimizer": type(learn.opt).__name__ if learn.opt is not None else None,
            "world_size": collective.world_size,
            "data_seed": learn.data_seed,
            "rng": [rng for rng, _ in ranks],
            "stream": [stream for _, stream in ranks],
            "scaler": learn.scaler.state_dict() if learn.scaler is not None else None,
            "recorder_partial": learn.recorder.partial_state() if batches_done else None,  # (a collective)
            **{key: part.state_dict() for key, part in self._parts().items()},
        }
        # The strategy names the format: "dcp", every rank writes its shards (checkpoint/sharded.py).
        written = save(
            self.file, learn.checkpoint_format, self._weights(), state, collective, self.keep_previous
        )
        self.saves += 1
        return written

    def _weights(self) -> Weights:
        return Weights(self.learn.model, self.learn.raw_model, self.learn.opt)

    def _parts(self) -> dict[str, Any]:
        """What the checkpoint holds besides weights, position and RNG, under its key on disk: the
        recorder, every other stateful callback (by class name and index among its kind), and the
        components it is handed (loaded after the optimizer, its hyper-parameters kept)."""
        learn = self.learn
        seen: Counter[str] = Counter()
        callbacks = {}
        for cb in learn.cbs:
            if cb is not self and cb is not learn.recorder:
                name = type(cb).__name__
                callbacks[f"{name}:{seen[name]}"] = cb
                seen[name] += 1
        return {
            "recorder": learn.recorder,
            "callbacks": Group(callbacks, skip_empty=True),
            "components": Group(self.components, keep=learn.opt),
        }

    def restore_latest(self) -> StartPoint | None:
        """Load the newest checkpoint into the model, optimizer, recorder, callbacks, components and
        RNG states, and return where `fit` continues (`unison.engine.start_at` puts it in place);
        None if there is no checkpoint."""
        learn, collective = self.learn, self.learn.collective
        fmt = learn.checkpoint_format
        found = find(self.file, fmt, self._weights(), collective, self.keep_previous)
        if found is None:
            return None
        state = {**found.state, "components": found.state.get("components") or {}}
        step = self._step(state)
        check_components(self.components, state["components"], found.source)
        if learn.opt is None:  # (made now to be compared; the weights are loaded after every check)
            learn.create_opt()
        self._check_optimizer(state, found.source)
        # Everything is checked: now change the learner.
        load_weights(found, self._weights(), fmt, collective)
        for key, part in self._parts().items():
            part.load_state_dict(state[key])
        learn.recorder.resume_partial(state["recorder_partial"], collective.rank, collective.world_size)
        rank, rng, streams = collective.rank, state["rng"], state.get("stream") or []
        set_rng_state(rng[rank % len(rng)])
        return StartPoint(
            epoch=state["epoch"],
            step=step,
            data_seed=state["data_seed"],
            stream_state=streams[rank] if len(streams) == collective.world_size else None,
            scaler_state=state.get("scaler"),
        )

    def _check_optimizer(self, state: dict[str, Any], source: Path) -> None:
        """Refuse a checkpoint of another kind of optimizer, or of other param groups, in one line: its
        state would be read under other names (a crash at the first step) or into other groups."""
        opt, was = self.learn.opt, state.get("optimizer")
        now = type(opt).__name__ if opt is not None else None
        if was is not None and now is not None and was != now:
            raise CheckpointError(
                f"{source} holds the state of the optimizer {was}, this run trains with {now}: resume with "
                f"the interrupted run's optimizer, or start a new fit from learn.load(..., with_opt=False)"
            )
        saved_groups = [len(group["params"]) for group in (state.get("opt") or {}).get("param_groups", [])]
        groups = [len(group["params"]) for group in opt.param_groups] if opt is not None else []
        if saved_groups and groups and saved_groups != groups:
            raise CheckpointError(
                f"{source} holds an optimizer with param groups of {saved_groups} tensors, this run's has "
                f"{groups}: resume with the interrupted run's splitter / param groups"
            )

    def _step(self, state: dict[str, Any]) -> int:
        """The training step of its epoch that checkpoint `state` stopped at, at this run's global
        batch (an optimizer step's items: batch_size x processes x accumulated batches): refused when
        it is not a whole number of them, or when the train data changed; a changed global batch warned."""
        batch = self._global_batch()
        accumulate, was_accumulate = self._accumulate(), state.get("accumulate") or 1
        samples = state["samples_done"]
        if batch is None:  # a batch sampler's loader: global step k is its batch k on any W
            batch, samples = 1, state.get("steps_done", samples)
        self._check_items(state, samples)
        if samples % (batch * accumulate):
            raise CheckpointError(
                f"{self.file} stopped {samples} samples into epoch {state['epoch']}, not a whole number "
                f"of global batches of {batch * accumulate} (batch_size x processes"
                f"{' x accumulate' if accumulate > 1 else ''}): resume with the global batch "
                f"of the interrupted run ({(state['global_batch'] or 1) * was_accumulate})"
            )
        was, now = state.get("global_batch"), self._global_batch()
        if was is not None and now is not None and was * was_accumulate != now * accumulate:
            per_step = f" x accumulate {accumulate}" if accumulate > 1 else ""
            # Allowed (an elastic job that lost a node resumes smaller), but never silently.
            self._warn(
                f"resuming {self.file} at a global batch of {now * accumulate} (batch_size x "
                f"{self.learn.collective.world_size} processes{per_step}) "
                f"where the interrupted run had {was * was_accumulate}: from here the run no longer equals "
                "the uninterrupted one",
            )
        return samples // batch

    def _check_items(self, state: dict[str, Any], samples: int) -> None:
        """Refuse a checkpoint written over other train data (another length, other items): resumed
        mid-epoch, the epoch's order would deal some items twice and others never; at an epoch's end,
        it is most often another run's checkpoint in the same file (a k-fold loop), which the
        resume would silently take as its own."""
        (was, was_print), (now, now_print) = (
            (state.get("train_items"), state.get("train_data")),
            self._train_data(),
        )
        if was is not None and now is not None and was != now and samples:
            raise CheckpointError(
                f"{self.file} stopped {samples} samples into epoch {state['epoch']} of a dataset of {was} "
                f"items, this run's has {now}: the epoch's order would deal some items twice and others "
                "never; resume with the interrupted run's dataset"
            )
        if was_print is not None and now_print is not None and was_print != now_print:
            differ = (
                f"{was} items, this run's has {now}" if was != now else "its items differ from this run's"
            )
            raise CheckpointError(
                f"{self.file} was written over another train dataset ({differ}): another run writes this "
                "file (give each run its own Checkpoint(fname=...)), or the data changed; resume with the "
                "interrupted run's data, or move the file away to start afresh"
            )

    def _warn(self, message: str) -> None:
        if self.learn.collective.is_main:  # (once per job)
            warnings.warn(message, GlobalBatchChangedWarning, stacklevel=4)

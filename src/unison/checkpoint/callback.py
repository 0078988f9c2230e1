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
import secrets
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.checkpoint.components import check_components, component_states, load_components
from unison.checkpoint.errors import CheckpointError
from unison.checkpoint.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    atomic_save,
    check_state_fits,
    load_or_previous,
    remove_stale_temps,
)
from unison.checkpoint.sharded import checked_source, load_sharded_weights, save_sharded, sharded_path
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
        probe = folder / f".unison-write-test.{os.getpid()}.{secrets.token_hex(4)}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
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
        #: True while a save runs: a write in progress is progress (the preemption stall rule reads it).
        self.writing = False

    @property
    def file(self) -> Path:
        probe = os.environ.get(PROBE_ENV)
        if probe:  # under `unison check-exact`: each run from scratch, the script's checkpoints untouched
            return Path(f"{probe}.checkpoints") / f"{self.fname}.pth"
        return self.learn.path / self.learn.model_dir / f"{self.fname}.pth"

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
        learn = self.learn
        collective = learn.collective
        # A stateful stream's state on every rank (each reads its own part), mid-epoch only.
        stateful = batches_done and hasattr(learn.dl, "load_state_dict")
        stream_state = learn.dl.state_dict() if stateful else None
        gathered = collective.gather_objects((get_rng_state(), stream_state))
        rng_states = [rng for rng, _ in gathered]
        stream_states = [stream for _, stream in gathered]
        recorder_partial = learn.recorder.partial_state() if batches_done else None
        sharded = learn.checkpoint_format == "dcp"  # every rank writes its shards (checkpoint/sharded.py)
        if collective.is_main or sharded:
            assert learn.opt is not None
            state: dict[str, Any] = {
                FORMAT_KEY: FORMAT_VERSION,
                "kind": "checkpoint",
                "model": None if sharded else learn.raw_model.state_dict(),
                "opt": None if sharded else learn.opt.state_dict(),
                "scaler": learn.scaler.state_dict() if learn.scaler is not None else None,
                "epoch": epoch,
                "samples_done": batches_done * (self._global_batch() or 1),
                "steps_done": batches_done,
                "global_batch": self._global_batch(),
                "world_size": collective.world_size,
                "data_seed": learn.data_seed,
                "rng": rng_states,
                "stream": stream_states,
                "recorder": learn.recorder.state_dict(),
                "recorder_partial": recorder_partial,
                "callbacks": self._callback_states(),
                "components": component_states(self.components),
            }
            if sharded:
                save_sharded(
                    sharded_path(self.file), learn.model, learn.opt, state, collective, self.keep_previous
                )
            else:
                atomic_save(state, self.file, self.keep_previous)
        self.saves += 1
        return sharded_path(self.file) if sharded else self.file

    def _keys(self) -> list[tuple[str, Callback]]:
        """A stable name for each stateful callback: class name and its index among its kind."""
        seen: Counter[str] = Counter()
        keys = []
        for cb in self.learn.cbs:
            if cb is self or cb is self.learn.recorder:
                continue
            name = type(cb).__name__
            keys.append((f"{name}:{seen[name]}", cb))
            seen[name] += 1
        return keys

    def _callback_states(self) -> dict[str, dict[str, Any]]:
        return {key: cb.state_dict() for key, cb in self._keys() if cb.state_dict()}

    def restore_latest(self) -> StartPoint | None:
        """Load the newest checkpoint into the model, optimizer, recorder, callbacks, components and
        RNG states, and return where `fit` continues (`unison.engine.start_at` puts it in place);
        None if there is no checkpoint."""
        learn = self.learn
        if learn.collective.is_main:  # the writer's rank: temp files of a save a kill cut short
            remove_stale_temps(self.file)
        # a sharded run's checkpoint folder, verified (or the previous one, when kept)
        sharded = learn.checkpoint_format == "dcp"
        folder, sharded_state = checked_source(
            self.file, learn.model, learn.collective, self.keep_previous, sharded=sharded
        )
        if sharded_state is not None:
            state = sharded_state
        elif self.file.exists():
            # Loaded to the CPU, as Lightning does: generator states must be CPU byte tensors, and the
            # recorder's sums mix with CPU ones; the model and optimizer copy theirs to their own device.
            state = load_or_previous(
                self.file, self.keep_previous, learn.collective.is_main, map_location="cpu", kind="checkpoint"
            )
            check_state_fits(learn.raw_model, state["model"], self.file)
        else:
            return None
        global_batch = self._global_batch()
        samples = state["samples_done"]
        if global_batch is None:  # a batch sampler's loader: global step k is its batch k on any W
            global_batch, samples = 1, state.get("steps_done", samples)
        if samples % global_batch:
            raise CheckpointError(
                f"{self.file} stopped {samples} samples into epoch {state['epoch']}, not a whole number "
                f"of global batches of {global_batch} (batch_size x processes): resume with the global batch "
                f"of the interrupted run ({state['global_batch']})"
            )
        was, now = state.get("global_batch"), self._global_batch()
        if was is not None and now is not None and was != now and learn.collective.is_main:
            # Allowed (an elastic job that lost a node resumes smaller), but never silently.
            warnings.warn(
                f"resuming {self.file} at a global batch of {now} (batch_size x "
                f"{learn.collective.world_size} processes) where the interrupted run had {was}: "
                "from here the run no longer equals the uninterrupted one",
                GlobalBatchChangedWarning,
                stacklevel=2,
            )
        components = state.get("components") or {}
        check_components(self.components, components, folder or self.file)
        # Everything is checked: now change the learner.
        if learn.opt is None:
            learn.create_opt()
        assert learn.opt is not None
        if not load_sharded_weights(learn, folder, state):  # a plain checkpoint into a plain model
            learn.raw_model.load_state_dict(state["model"])
            learn.opt.load_state_dict(state["opt"])
        learn.recorder.load_state_dict(state["recorder"])
        learn.recorder.resume_partial(
            state["recorder_partial"], learn.collective.rank, learn.collective.world_size
        )
        for key, cb in self._keys():
            if key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][key])
        load_components(self.components, components, learn.opt)
        rank = learn.collective.rank
        rng = state["rng"]
        set_rng_state(rng[rank] if rank < len(rng) else rng[rank % len(rng)])
        streams = state.get("stream") or []
        same_world = len(streams) == learn.collective.world_size
        return StartPoint(
            epoch=state["epoch"],
            step=samples // global_batch,
            data_seed=state["data_seed"],
            stream_state=streams[rank] if same_world and rank < len(streams) else None,
            scaler_state=state.get("scaler"),
        )

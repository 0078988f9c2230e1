"""Experiment trackers: `WandbLogger` (Weights & Biases) and `MLflowLogger`, on rank 0 only.

Each logs the run's configuration once, every training step's loss (the global batch's, as the
`Recorder` reduced it over all ranks) and learning rate, and every epoch's values, and can attach
the checkpoint to the run as an artifact. What no other trainer does: a run resumed from a
checkpoint (after a kill, a preemption or a restart) continues the *same* tracker run, and no
step is logged twice or left out. The run's id and the next step to log travel in the checkpoint
(the callback's `state_dict`), and where the tracker can say which steps it already holds
(MLflow always; W&B when online) that wins: steps logged after the checkpoint was written are
not logged again when the resumed run computes them a second time (the same values: resume is
exact).

Steps are logged at each epoch's end: the global batch's loss needs every rank's, and the
recorder reduces them once per epoch, not once per step.

    learn.fit(3, cbs=[MLflowLogger(experiment="digits", config={"arch": "resnet18"})])
    learn.fit(3, cbs=[WandbLogger(project="digits"), Checkpoint(every=100)], resume=True)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from unison.callbacks.loggers import optional_import
from unison.events import Callback

__all__ = ["MLflowLogger", "TrackerLogger", "WandbLogger"]


class TrackerRun(Protocol):
    """One run of an experiment tracker, as `TrackerLogger` drives it."""

    def start(self, run_id: str | None, config: dict[str, Any]) -> tuple[str, int | None]:
        """Open a new run (`run_id` None: log `config`) or reopen `run_id`; return its id and the next
        step the tracker expects, when it knows (None otherwise)."""
        ...

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Log each `(step, {name: value})`, in step order."""
        ...

    def attach(self, path: Path) -> None:
        """Attach the file or folder `path` to the run (an artifact)."""
        ...

    def finish(self) -> None:
        """Close the run (it can be reopened)."""
        ...


class TrackerLogger(Callback):
    """Logs the learner's run to an experiment tracker (`run`), resumable with the checkpoint.

    Subclasses only choose the tracker (`WandbLogger`, `MLflowLogger`).
    """

    order = 60  # after the Recorder (50) has reduced the epoch; before Checkpoint (90) saves our state

    def __init__(
        self, run: TrackerRun, config: Mapping[str, Any] | None = None, log_checkpoint: bool = False
    ):
        self.run = run
        self.config = dict(config or {})
        self.log_checkpoint = log_checkpoint
        self.run_id: str | None = None
        self.next_step = 0  # the next global step to log (counted from the run's first step)
        self._offset = 0  # the recorder's index of the run's step 0
        self._restored: dict[str, Any] | None = None
        self._open = False

    def state_dict(self) -> dict[str, Any]:
        if self.run_id is None:
            return {}
        return {"run_id": self.run_id, "next_step": self.next_step, "offset": self._offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = dict(state)

    def before_fit(self) -> None:
        learn = self.learn
        if not learn.collective.is_main or learn.recorder.paused:  # (paused: lr_find's sweep, not a run)
            return
        restored, self._restored = self._restored, None
        if self.log_checkpoint and self._checkpoint_file() is None:
            raise ValueError(f"{type(self).__name__}(log_checkpoint=True) needs a Checkpoint callback")
        if restored is not None:  # fit(resume=True) loaded a checkpoint: the same run goes on
            self._offset = int(restored["offset"])
            self.run_id, known = self.run.start(str(restored["run_id"]), {})
            saved = int(restored["next_step"])
            self.next_step = saved if known is None else known
        else:
            self._offset = len(learn.recorder.losses)
            self.run_id, _ = self.run.start(None, self._full_config())
            self.next_step = 0
        self._open = True

    def _full_config(self) -> dict[str, Any]:
        """The user's config, and what the learner knows of the run (the user's keys win)."""
        learn = self.learn
        train = learn.dls.train
        batch = getattr(train, "batch_size", None)
        world = learn.collective.world_size
        described: dict[str, Any] = {
            "epochs": learn.n_epoch,
            "lr": learn.lr if isinstance(learn.lr, (int, float)) else str(learn.lr),
            "batch_size": batch,
            "world_size": world,
            "global_batch": batch * world if isinstance(batch, int) else None,
            "optimizer": getattr(learn.opt_func, "__name__", type(learn.opt_func).__name__),
            "model": type(learn.raw_model).__name__,
            "loss_func": getattr(learn.loss_func, "__name__", type(learn.loss_func).__name__),
            "parameters": sum(p.numel() for p in learn.raw_model.parameters()),
        }
        return {**described, **self.config}

    def after_epoch(self) -> None:
        if not self._open:
            return
        recorder = self.learn.recorder
        rows: dict[int, dict[str, float]] = {}
        for index in range(self._offset + self.next_step, len(recorder.losses)):
            row = {"train/loss": float(recorder.losses[index])}
            if index < len(recorder.lrs):
                row["train/lr"] = float(recorder.lrs[index])
            rows[index - self._offset] = row
        last = len(recorder.losses) - 1 - self._offset  # the epoch's values go with its last step
        if recorder.values and last >= self.next_step:
            values = {f"epoch/{n}": float(v) for n, v in recorder.last_values().items()}
            rows.setdefault(last, {}).update(
                {"epoch/index": float(self.learn.epoch), **values, "epoch/time_s": float(recorder.times[-1])}
            )
        if rows:
            self.run.log(sorted(rows.items()))
            self.next_step = max(rows) + 1

    def after_fit(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            checkpoint = self._checkpoint_file() if self.log_checkpoint else None
            if checkpoint is not None and checkpoint.exists():
                self.run.attach(checkpoint)
        finally:
            self.run.finish()

    def _checkpoint_file(self) -> Path | None:
        from unison.checkpoint.callback import Checkpoint  # (the checkpoint package imports callbacks)
        from unison.checkpoint.sharded import sharded_path

        checkpoint = self.learn.get_cb(Checkpoint)
        if checkpoint is None:
            return None
        sharded = sharded_path(checkpoint.file)
        return sharded if sharded.exists() else checkpoint.file


class WandbLogger(TrackerLogger):
    """Log to Weights & Biases (`pip install 'unison[wandb]'`), rank 0 only.

    `project`, `name`, `entity`, `dir`, `mode` ("online", "offline") and `tags` go to `wandb.init`;
    `config` is logged once with what the learner knows (epochs, lr, batch size, world size, ...).
    The W&B run's id is kept in the checkpoint, so `fit(resume=True)` continues the same run.

        learn.fit(3, cbs=[WandbLogger(project="digits", config={"arch": "resnet18"})])
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        log_checkpoint: bool = False,
        **init_kwargs: Any,
    ):
        super().__init__(_WandbRun(project, name, init_kwargs), config, log_checkpoint)


class MLflowLogger(TrackerLogger):
    """Log to MLflow (`pip install 'unison[mlflow]'`), rank 0 only.

    `tracking_uri` (default: MLflow's, from `MLFLOW_TRACKING_URI`), `experiment` (created if
    missing) and `run_name` choose where; `config` is logged once as the run's parameters.
    The run's id is kept in the checkpoint, so `fit(resume=True)` continues the same run.

        learn.fit(3, cbs=[MLflowLogger(tracking_uri="file:///tmp/mlruns", experiment="digits")])
    """

    def __init__(
        self,
        experiment: str = "unison",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        config: Mapping[str, Any] | None = None,
        log_checkpoint: bool = False,
        tags: Mapping[str, str] | None = None,
    ):
        super().__init__(
            _MlflowRun(experiment, run_name, tracking_uri, dict(tags or {})), config, log_checkpoint
        )


class _WandbRun:
    """A W&B run driven through the `wandb` package (online, or offline to local files)."""

    #: Seconds between W&B's writes of a run to its local `.wandb` file (its default is 15): what a
    #: killed process had logged but W&B had not written yet is lost, so keep that short.
    FLUSH_S = 1.0

    def __init__(self, project: str | None, name: str | None, init_kwargs: dict[str, Any]):
        self.project, self.name, self.init_kwargs = project, name, init_kwargs
        self._run: Any = None

    def start(self, run_id: str | None, config: dict[str, Any]) -> tuple[str, int | None]:
        wandb = optional_import("wandb", "this logger", "wandb")
        kwargs = dict(self.init_kwargs)
        if "settings" not in kwargs and "x_transaction_log_flush_interval" in wandb.Settings.model_fields:
            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=self.FLUSH_S)
        new_or_again = {"config": config} if run_id is None else {"id": run_id, "resume": "allow"}
        self._run = wandb.init(project=self.project, name=self.name, **new_or_again, **kwargs)
        # Online, a resumed run knows the next step its server expects; offline, nothing (0).
        known = self._run.step if run_id is not None and not self._run.offline else None
        return str(self._run.id), known

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self._run.log(values, step=step, commit=True)  # committed now: no row left open at a kill

    def attach(self, path: Path) -> None:
        wandb = optional_import("wandb", "this logger", "wandb")
        artifact = wandb.Artifact(f"checkpoint-{self._run.id}", type="model")
        artifact.add_dir(str(path)) if path.is_dir() else artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class _MlflowRun:
    """An MLflow run driven through `MlflowClient` (no global active run is touched)."""

    _BATCH = 1000  # MLflow's limit of metrics in one log_batch

    def __init__(self, experiment: str, run_name: str | None, tracking_uri: str | None, tags: dict[str, str]):
        self.experiment, self.run_name, self.tracking_uri, self.tags = (
            experiment,
            run_name,
            tracking_uri,
            tags,
        )
        self._client: Any = None
        self.run_id: str | None = None

    def start(self, run_id: str | None, config: dict[str, Any]) -> tuple[str, int | None]:
        tracking = optional_import("mlflow.tracking", "this logger", "mlflow")
        self._client = client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        if run_id is not None:
            client.get_run(run_id)  # raises, naming the run, when the store does not have it
            client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            history = client.get_metric_history(run_id, "train/loss")  # written as logged: exact
            return run_id, max((m.step for m in history), default=-1) + 1
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        params = [(key, str(value)[:6000]) for key, value in config.items()]
        entities = optional_import("mlflow.entities", "this logger", "mlflow")
        client.log_batch(self.run_id, params=[entities.Param(k, v) for k, v in params])
        return self.run_id, None

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        entities = optional_import("mlflow.entities", "this logger", "mlflow")
        now = int(time.time() * 1000)
        metrics = [entities.Metric(k, v, now, step) for step, values in rows for k, v in values.items()]
        # "train/loss" last in each step's batch: a kill inside log_batch never reads as "logged"
        metrics.sort(key=lambda m: (m.step, m.key == "train/loss"))
        for start in range(0, len(metrics), self._BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + self._BATCH])

    def attach(self, path: Path) -> None:
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
        else:
            self._client.log_artifact(self.run_id, str(path))

    def finish(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)

"""`WandbLogger` and `MLflowLogger`, for real and offline, read back with the trackers' own formats.

W&B runs in offline mode (WANDB_MODE=offline, a temporary WANDB_DIR): its run is read back from
the `.wandb` file it wrote (a LevelDB-style log of W&B's own protobuf `Record`s; wandb 0.31 has no
Python reader of it, its reader is in the Go service, so `wandb_records` below walks the blocks
and parses each record with `wandb.proto.wandb_internal_pb2.Record`). MLflow logs to a file store
(a `file://` URI in a temporary folder), read back with `MlflowClient`. Every logged value is
checked against a plain training loop written here.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.hangs import run_or_report

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
mlflow_tracking = pytest.importorskip("mlflow.tracking")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fault_scripts" / "tracked.py"
EPOCHS, STEPS, BS, LR = 3, 8, 4, 0.05  # as in tracked.py
WAIT_S = 120


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """tracked.py's data."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 5, generator=g)
    return x, x @ torch.linspace(-1, 1, 5).unsqueeze(1) + 0.1 * torch.randn(48, 1, generator=g)


def plain_run(opt_name: str) -> tuple[list[float], list[float]]:
    """Every step's training loss and every epoch's validation loss of a plain loop (the expected values)."""
    from unison import set_seed

    set_seed(0)
    model = nn.Linear(5, 1)  # the script's model, made right after the same seed
    opt = (torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW)(model.parameters(), lr=LR)
    x, y = data()
    losses, valid = [], []
    for _ in range(EPOCHS):
        for k in range(STEPS):
            loss = nn.functional.mse_loss(model(x[k * BS : (k + 1) * BS]), y[k * BS : (k + 1) * BS])
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            valid.append(nn.functional.mse_loss(model(x[STEPS * BS :]), y[STEPS * BS :]).item())
    return losses, valid


def wandb_records(path: Path) -> list[object]:
    """The `Record`s of a `.wandb` file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
    of chunks, each with a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    raw, block, pos, records, pending = path.read_bytes(), 32768, 7, [], b""
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:  # zeros: the rest of the block is padding
            pos += block - pos % block
            continue
        pending = (
            raw[pos + 7 : pos + 7 + length] if kind in (1, 2) else pending + raw[pos + 7 : pos + 7 + length]
        )
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(wandb_dir: Path, run_id: str) -> tuple[list[tuple[int, dict]], list[dict], list[str]]:
    """Every history row `(step, values)` of the run `run_id`, over all its offline segments (one per
    process that ran it, in order), its config updates, and the names of the artifacts it logged."""
    rows, configs, artifacts = [], [], []
    for file in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                # (a key is either `key` or, split at its slashes, `nested_key`)
                items = record.history.item
                values = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items
                }
                rows.append((values["_step"], {k: v for k, v in values.items() if not k.startswith("_")}))
            elif kind in ("run", "config"):
                update = (record.run.config if kind == "run" else record.config).update
                configs.append({u.key: json.loads(u.value_json) for u in update if u.key != "_wandb"})
            elif kind == "artifact":
                artifacts.append(record.artifact.name)
    return rows, [c for c in configs if c], artifacts


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def check_mlflow_run(uri, run_id, losses, valid):
    """The experiment holds this one MLflow run, with every step's loss and each epoch's valid loss
    equal to the plain loop's."""
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("unison-tests")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = mlflow_history(uri, run_id, "train/loss")
    check_steps([(s, {"train/loss": v, "train/lr": LR}) for s, v in history], losses)
    assert [v for _, v in mlflow_history(uri, run_id, "epoch/valid_loss")] == pytest.approx(valid, rel=1e-5)


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps its file store behind this switch
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def check_steps(rows: list[tuple[int, dict]], losses: list[float]) -> None:
    """Each step 0..N-1 logged once, with the plain loop's loss and the learning rate."""
    steps = [step for step, values in rows if "train/loss" in values]
    assert steps == list(range(len(losses))), steps  # no step missing, none twice, in order
    logged = [values["train/loss"] for _, values in rows if "train/loss" in values]
    assert logged == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert all(values.get("train/lr") == pytest.approx(LR) for _, values in rows if "train/loss" in values)


@pytest.mark.procs  # (wandb runs a service process of its own)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_both_trackers_log_config_steps_epochs_and_the_checkpoint(tmp_path, tracker_env, opt_name):
    from unison import Checkpoint, DataLoaders, Learner, MLflowLogger, WandbLogger, set_seed

    set_seed(0)
    x, y = data()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[: STEPS * BS], y[: STEPS * BS]), batch_size=BS),
        DataLoader(TensorDataset(x[STEPS * BS :], y[STEPS * BS :]), batch_size=8),
    )
    uri = (tmp_path / "mlruns").as_uri()
    # (dir: wandb reads WANDB_DIR once per process, and this test runs twice)
    wandb_logger = WandbLogger(
        project="unison-tests", config={"arch": "linear"}, log_checkpoint=True, dir=tmp_path
    )
    mlflow_logger = MLflowLogger(tracking_uri=uri, config={"arch": "linear"}, log_checkpoint=True)
    opt = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    cbs = [Checkpoint(), wandb_logger, mlflow_logger]
    learn = Learner(dls, nn.Linear(5, 1), nn.MSELoss(), opt_func=opt, lr=LR, cbs=cbs, path=tmp_path)
    learn.recorder.print_table = False
    learn.fit(EPOCHS)
    losses, valid = plain_run(opt_name)

    rows, configs, artifacts = wandb_run(tmp_path, wandb_logger.run_id)
    check_steps(rows, losses)
    epochs = [(step, v) for step, v in rows if "epoch/valid_loss" in v]
    assert [step for step, _ in epochs] == [STEPS * (e + 1) - 1 for e in range(EPOCHS)]  # with its last step
    assert [v["epoch/valid_loss"] for _, v in epochs] == pytest.approx(valid, rel=1e-5)
    assert [v["epoch/index"] for _, v in epochs] == [0, 1, 2]
    assert configs == [{**configs[0], "arch": "linear", "world_size": 1, "batch_size": BS, "epochs": EPOCHS}]
    assert configs[0]["optimizer"] == opt.__name__ and configs[0]["lr"] == LR
    assert artifacts == [f"checkpoint-{wandb_logger.run_id}"]

    run_id = mlflow_logger.run_id
    check_steps([(s, {"train/loss": v, "train/lr": lr}) for (s, v), (_, lr) in zip(
        mlflow_history(uri, run_id, "train/loss"), mlflow_history(uri, run_id, "train/lr"), strict=True
    )], losses)  # fmt: skip
    assert [v for _, v in mlflow_history(uri, run_id, "epoch/valid_loss")] == pytest.approx(valid, rel=1e-5)
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params["arch"] == "linear" and run.data.params["world_size"] == "1"
    assert run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id)] == ["checkpoint.pth"]


@pytest.mark.procs
def test_a_killed_run_resumed_continues_the_same_runs_without_a_gap_or_a_repeat(tmp_path, tracker_env):
    """SIGKILL in epoch 1 (epoch 0 logged and checkpointed, epoch 1 checkpointed up to some step), then
    fit(resume=True) in a new process: one W&B run and one MLflow run, every step exactly once."""
    uri = (tmp_path / "mlruns").as_uri()
    cmd = [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "run"), "--mlflow", uri]
    # Not WANDB_SERVICE: a W&B run made in this process (the test above) left its service's address
    # there, and the killed child's run would stay open in that service instead of dying with it.
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, **tracker_env}
    first = subprocess.Popen(
        [*cmd, "--slow-from", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + WAIT_S
    try:
        while True:  # kill it once both trackers hold epoch 0 (on disk), while epoch 1 runs (0.5 s a step)
            assert first.poll() is None, first.communicate()[0].decode()
            assert time.monotonic() < deadline, "epoch 0 never reached the trackers"
            files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
            runs = list((tmp_path / "mlruns").glob("*/*/metrics/train"))
            if files and runs:
                run_id = files[0].stem.removeprefix("run-")
                in_wandb = [s for s, v in wandb_run(tmp_path, run_id)[0] if "train/loss" in v]
                in_mlflow = mlflow_history(uri, runs[0].parent.parent.name, "train/loss")
                if len(in_wandb) >= STEPS and len(in_mlflow) >= STEPS:
                    break
            time.sleep(0.2)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert len(in_mlflow) == STEPS  # killed inside epoch 1, before it was logged

    second = run_or_report([*cmd, "--resume"], WAIT_S, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    ids = json.loads(second.stdout.split("RUNS ", 1)[1])
    losses, valid = plain_run("sgd")

    assert ids["wandb"] == run_id  # the same W&B run, continued
    segments = sorted(tmp_path.glob(f"wandb/offline-run-*-{run_id}"))
    assert len(segments) == 2  # the killed process's and the resumed one's
    rows, configs, _ = wandb_run(tmp_path, run_id)
    check_steps(rows, losses)
    assert [v["epoch/valid_loss"] for _, v in rows if "epoch/valid_loss" in v] == pytest.approx(
        valid, rel=1e-5
    )
    assert len([c for c in configs if "arch" in c]) == 1  # the configuration once

    check_mlflow_run(uri, ids["mlflow"], losses, valid)


@pytest.mark.launch
def test_under_unison_launch_rank0_alone_logs_the_global_batch_losses(tmp_path, tracker_env):
    """2 processes, each with half of every global batch of 4: one W&B run and one MLflow run (rank 0
    logs), and their losses are the global batch's, the plain one-process loop's."""
    uri = (tmp_path / "mlruns").as_uri()
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, **tracker_env}
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", str(SCRIPT), "--dir", str(tmp_path / "run")]
    done = run_or_report([*cmd, "--mlflow", uri], WAIT_S, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = json.loads(done.stdout.split("[rank0] RUNS ", 1)[1].splitlines()[0])
    assert "[rank1] RUNS " in done.stdout and len(list(tmp_path.glob("wandb/offline-run-*"))) == 1
    losses, valid = plain_run("sgd")
    rows, configs, _ = wandb_run(tmp_path, ids["wandb"])
    check_steps(rows, losses)
    assert configs[0]["world_size"] == 2 and configs[0]["global_batch"] == BS
    check_mlflow_run(uri, ids["mlflow"], losses, valid)

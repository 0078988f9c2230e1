"""The unison training script, run by Ray Train: `TorchTrainer` starts the workers and their process group.

    python examples/ray/train_ray.py --workers 2 --storage /shared/ray-runs --name tiny
    python examples/ray/train_ray.py --address auto ...      # on a running Ray cluster

Each Ray worker runs `train_loop_per_worker`, the same script shape as `examples/train_digits.py`:
build a `Learner`, then `with learn.distrib_ctx(): learn.fit(...)`. Ray has already made the process
group (gloo on CPU) and set RANK / LOCAL_RANK / WORLD_SIZE; `distrib_ctx` adopts that group as it
is (it never makes a second one, nor destroys Ray's at the end) and shards the data exactly, so W
workers at batch `bs` train as one process at batch `W * bs`.

Checkpoints: the Learner writes them (`Checkpoint(every=N)`) into `<storage>/<name>/unison`, on storage
every worker and every restart sees (for a multi-machine cluster: a shared file system); when a
worker dies, Ray's `FailureConfig(max_failures=K)` starts the worker group again, and
`fit(resume=True)` continues from the newest checkpoint there, mid-epoch. At the end rank 0 reports
the Learner's checkpoint folder to Ray (`ray.train.report`), so `result.checkpoint` holds it too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, Checkpoint, DataLoaders, Learner, accuracy, set_seed
from unison.distributed import num_distrib, rank_distrib

if TYPE_CHECKING:
    from ray.train import Result


def make_data(n_train: int = 128, n_valid: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """A small fixed classification set (no download): 6 features, 3 classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_valid, 6, generator=g)
    y = (x[:, :3] @ torch.tensor([1.0, -2.0, 0.5]) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def make_model() -> nn.Module:
    set_seed(0)  # the same initial weights on every worker (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


def digest(model: nn.Module) -> str:
    """sha256 of the weights, to compare runs."""
    return hashlib.sha256(
        b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
    ).hexdigest()


class DieOnce(Callback):
    """For the fault test: the worker of rank `rank` kills itself (SIGKILL) before training step `at`,
    once per run (a marker file in the checkpoint folder says it happened)."""

    def __init__(self, at: int, rank: int, marker: Path):
        self.at, self.rank, self.marker, self.steps = at, rank, marker, 0

    def before_batch(self) -> None:
        if not self.learn.training:
            return
        self.steps += 1
        if self.steps == self.at and rank_distrib() == self.rank and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def train_loop_per_worker(config: dict) -> None:
    """What every Ray worker runs (Ray made the process group already)."""
    import ray.train

    ckpt_dir = Path(config["ckpt_dir"])  # <storage>/<name>/unison: seen by every worker and restart
    x, y = make_data()
    n_train, bs = 128, config.get("bs", 8)
    dls = DataLoaders(
        DataLoader(
            TensorDataset(x[:n_train], y[:n_train]), batch_size=bs, shuffle=config.get("shuffle", True)
        ),
        DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=16),
    )
    cbs: list[Callback] = [Checkpoint(every=1)]
    if config.get("die_at"):
        cbs.append(DieOnce(config["die_at"], config.get("die_rank", 1), ckpt_dir / "died-once"))
    learn = Learner(
        dls, make_model(), nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=config.get("lr", 0.1),
        metrics=[accuracy], cbs=cbs, path=ckpt_dir,
    )  # fmt: skip
    learn.recorder.print_table = False
    group_before = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    with learn.distrib_ctx():
        learn.fit(config.get("epochs", 2), resume=True)
        valid_loss, valid_acc = learn.validate()
        world = num_distrib()
    still_ray_group = torch.distributed.is_initialized() and torch.distributed.group.WORLD is group_before
    metrics = {
        "weights": digest(learn.raw_model),
        "params": torch.cat([p.detach().flatten() for p in learn.raw_model.parameters()]).tolist(),
        "valid_loss": valid_loss,
        "valid_accuracy": valid_acc,
        "world": world,
        "rank": rank_distrib(),
        "steps": learn.get_cb(DieOnce).steps if config.get("die_at") else None,
        "adopted": group_before is not None and still_ray_group,
        "resumed": (ckpt_dir / "died-once").exists(),
    }
    if rank_distrib() == 0:  # rank 0 wrote the checkpoints: hand Ray their folder
        folder = ckpt_dir / "models"
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(folder)))
    else:
        ray.train.report(metrics)


def fit_with_ray(workers: int, storage: str, name: str, max_failures: int = 1, **config) -> Result:
    """Run `train_loop_per_worker` on `workers` Ray workers (CPU, gloo); return Ray's result."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config.setdefault("ckpt_dir", os.path.join(storage, name, "unison"))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=name, storage_path=storage, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


if __name__ == "__main__":
    import ray

    parser = argparse.ArgumentParser(description="unison under Ray Train")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "ray-runs"))
    parser.add_argument("--name", default="unison-ray")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bs", type=int, default=8, help="batch size per worker")
    parser.add_argument("--address", help="a running Ray cluster (default: a local one)")
    args = parser.parse_args()
    ray.init(address=args.address, include_dashboard=False)
    result = fit_with_ray(args.workers, args.storage, args.name, epochs=args.epochs, bs=args.bs)
    print({k: v for k, v in result.metrics.items() if k != "params"})
    print(f"checkpoint: {result.checkpoint}")

"""A single-process fit logged to W&B (offline) and MLflow (a file store) at once, for the tracker tests.

    python tracked.py --dir D --mlflow file:///tmp/mlruns [--slow-from 1] [--resume] [--opt adamw]

8 training steps an epoch, 3 epochs, checkpointed every step. Under `unison launch --nproc 2` each
process takes half of each global batch of 4 (inside `distrib_ctx`): the same run. `--slow-from E`
makes every step of epoch E and later take 0.5 s (a test kills the process there); `--resume` fits
with resume=True. W&B is told where and how by its variables (WANDB_MODE=offline, WANDB_DIR).
Prints `RUNS {json}` (the two run ids) at the end.
"""

import argparse
import contextlib
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, Checkpoint, DataLoaders, Learner, MLflowLogger, WandbLogger, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--mlflow", required=True, help="MLflow tracking URI")
parser.add_argument("--slow-from", type=int, default=99, help="steps of this epoch on take 0.5 s")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--opt", choices=("sgd", "adamw"), default="sgd")
args = parser.parse_args()

EPOCHS, STEPS, BS = 3, 8, 4
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # processes under unison launch


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The run's data and targets: the test builds the same for its plain loop."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 5, generator=g)
    return x, x @ torch.linspace(-1, 1, 5).unsqueeze(1) + 0.1 * torch.randn(48, 1, generator=g)


class Slow(Callback):
    def after_step(self) -> None:
        if self.learn.epoch >= args.slow_from:
            time.sleep(0.5)


set_seed(0)
x, y = data()
dls = DataLoaders(
    DataLoader(TensorDataset(x[: STEPS * BS], y[: STEPS * BS]), batch_size=BS // WORLD),
    DataLoader(TensorDataset(x[STEPS * BS :], y[STEPS * BS :]), batch_size=8),
)
model = nn.Linear(5, 1)
opt = torch.optim.SGD if args.opt == "sgd" else torch.optim.AdamW
trackers = [
    WandbLogger(project="unison-tests", config={"arch": "linear"}),
    MLflowLogger(tracking_uri=args.mlflow, experiment="unison-tests", config={"arch": "linear"}),
]
learn = Learner(
    dls,
    model,
    nn.MSELoss(),
    opt_func=opt,
    lr=0.05,
    cbs=[Checkpoint(every=1), Slow(), *trackers],
    path=args.dir,
)
learn.recorder.print_table = False
with learn.distrib_ctx() if WORLD > 1 else contextlib.nullcontext():
    learn.fit(EPOCHS, resume=args.resume)
print("RUNS " + json.dumps({"wandb": trackers[0].run_id, "mlflow": trackers[1].run_id}), flush=True)

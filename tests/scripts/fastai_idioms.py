"""fastai's tutorial idioms as a user writes them, on examples/fastai_bridge.py's tabular learner:
`lr_find`, `fit_one_cycle` at its valley, SaveModelCallback, EarlyStoppingCallback,
ReduceLROnPlateau and CSVLogger; the distributed part is fastai's own distributed script with only
its import changed (`from unison.fastai import *`, then `with learn.distrib_ctx(): ...`).

    python tests/scripts/fastai_idioms.py --plain --out one          # fastai alone, the global batch
    python -m unison.launch --nproc 2 tests/scripts/fastai_idioms.py --out two

Every rank writes `<out>.rank<R>.pt`: its final weights, the lr_find suggestion, the recorder's rows,
`validate()` and the messages it printed. The CSV log is `<out>.csv`.
"""

import argparse
import contextlib
import io
import os
import signal
import sys
from pathlib import Path

import torch
from fastai.tabular.all import (
    Callback,
    CSVLogger,
    EarlyStoppingCallback,
    GradientAccumulation,
    ReduceLROnPlateau,
    SaveModelCallback,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fastai_bridge import build  # noqa: E402  (the example's own DataLoaders and Learner)

from unison.fastai import *  # noqa: E402, F403  (was: from fastai.distributed import *)

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true", help="fastai alone, one process, no unison")
parser.add_argument("--out", required=True)
parser.add_argument("--bs", type=int, default=60, help="the global batch (2 and 3 processes divide it)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--no-lr-find", action="store_true")
parser.add_argument("--every", type=int, help="checkpoint every N steps; a restarted job resumes")
parser.add_argument("--kill-rank", type=int, help="SIGKILL this rank at epoch 1, step --at (once)")
parser.add_argument("--at", type=int, default=4)
parser.add_argument("--accumulate", type=int, help="fastai's GradientAccumulation(n_acc) over this many rows")
args = parser.parse_args()


class DoubleInputs(Callback):
    order = -4  # after the bridge trimmed and sharded the batch: the float64 model gets float64 inputs

    def before_batch(self) -> None:
        self.learn.xb = tuple(x.double() if x.is_floating_point() else x for x in self.learn.xb)

    def after_backward(self) -> None:
        self.learn.loss = self.learn.loss.float()  # (fastai's loss smoother is float32 whatever the model)


class Kill(Callback):
    order = 99

    def after_step(self) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if args.kill_rank == rank_distrib() and first_attempt and (self.epoch, self.iter) == (1, args.at):  # noqa: F405
            os.kill(os.getpid(), signal.SIGKILL)


torch.set_default_dtype(torch.float64)  # float64: one process and W agree to rounding, not float32 noise
world = 1 if args.plain else max(1, num_distrib())  # noqa: F405
out = Path(args.out)
learn = build(args.bs // world)
learn.model.double()
learn.add_cb(DoubleInputs())
learn.path = out.parent
callbacks = [
    SaveModelCallback(monitor="accuracy", min_delta=0.1, fname="best"),  # best: epochs 0 and 2
    EarlyStoppingCallback(monitor="valid_loss", patience=2),
    ReduceLROnPlateau(monitor="valid_loss", patience=1),
    CSVLogger(fname=f"{out.name}.csv", append=True),
    Kill(),
]
if args.accumulate:
    callbacks.append(GradientAccumulation(args.accumulate))
printed = io.StringIO()
resume = {"checkpoint_every": args.every, "resume": True} if args.every else {}
context = contextlib.nullcontext() if args.plain else learn.distrib_ctx(**resume)
with contextlib.redirect_stdout(printed), context:
    suggestion = None if args.no_lr_find else float(learn.lr_find(show_plot=False).valley)
    learn.fit_one_cycle(args.epochs, suggestion or 1e-2, cbs=callbacks)
    values = [[float(v) for v in row] for row in learn.recorder.values]
    final = [float(v) for v in learn.validate()]
torch.save(
    {
        "weights": {k: v.detach().clone() for k, v in learn.model.state_dict().items()},
        "suggestion": suggestion,
        "values": values,
        "final": final,
        "printed": printed.getvalue(),
    },
    f"{out}.rank{rank_distrib()}.pt",  # noqa: F405
)

"""examples/fastai_bridge.py's learner, in float64, trained either by fastai alone (`--plain`, one
process, the global batch) or bridged (`with distrib_ctx(learn):`, under `unison launch`, the global
batch split over the processes). Rank 0 writes the final weights, fastai's recorded rows, each
step's loss and `get_preds` on the validation set to `--out`.

    python tests/scripts/fastai_parity.py --plain --out one.pt
    python -m unison.launch --nproc 2 tests/scripts/fastai_parity.py --out two.pt
"""

import argparse
import os
import signal
import sys
import time
import weakref
from pathlib import Path

import torch
from fastai.tabular.all import SGD, Callback, num_distrib, rank_distrib

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fastai_bridge import build  # noqa: E402  (the example's own DataLoaders and Learner)

from unison.fastai import distrib_ctx  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true", help="fastai alone, no unison")
parser.add_argument("--out", required=True)
parser.add_argument("--bs", type=int, default=64, help="the global batch")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--opt", choices=("adam", "sgd"), default="adam")
parser.add_argument("--nan-rank", type=int, help="this rank's loss becomes NaN at --at")
parser.add_argument("--stall-rank", type=int, help="this rank stops taking part at --at")
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--kill-rank", type=int, help="SIGKILL it at epoch 1, step --at (once)")
parser.add_argument("--term-rank", type=int, help="SIGTERM it at epoch 1, step --at (a preemption)")
parser.add_argument("--every", type=int, help="a checkpoint every N steps, and resume from the newest")
parser.add_argument("--float32", action="store_true", help="as the example runs (docs/from-fastai.md)")
parser.add_argument("--no-sync-bn", action="store_true", help="BatchNorm per rank, as without exact sync BN")
args = parser.parse_args()


class Float64Batches(Callback):
    """The model in float64 sees float64 inputs (fastai's tabular loader gives float32)."""

    order = -4  # after the bridge trimmed and sharded the batch

    def before_batch(self) -> None:
        self.learn.xb = tuple(x.double() if x.is_floating_point() else x for x in self.learn.xb)


class Faults(Callback):
    order = -6  # before the bridge reads the loss

    def after_loss(self) -> None:
        if not self.training or self.iter != args.at or self.epoch != 0:
            return
        if args.nan_rank == rank_distrib():
            self.learn.loss_grad = self.learn.loss_grad * float("nan")
            self.learn.loss = self.learn.loss * float("nan")
        if args.stall_rank == rank_distrib():
            time.sleep(600)  # alive, silent: its peers must name it


class Kill(Callback):
    order = 99

    def after_step(self) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if args.kill_rank == rank_distrib() and first_attempt and (self.epoch, self.iter) == (1, args.at):
            os.kill(os.getpid(), signal.SIGKILL)
        if args.term_rank == rank_distrib() and (self.epoch, self.iter) == (1, args.at):
            os.kill(os.getpid(), signal.SIGTERM)


class StepLosses(Callback):
    """Each training step's loss in float64; fastai's smoothed loss then gets it as float32 (its
    `tensor()` makes the smoother float32 whatever the model, and it refuses a float64 loss)."""

    order = 10  # after the bridge set the global batch's loss (after_backward), before the Recorder (50)

    def __init__(self) -> None:
        self.losses = []  # (not in before_fit: get_preds fires it too)

    def after_backward(self) -> None:
        if self.training:
            self.losses.append(float(self.learn.loss))
            self.learn.loss = self.learn.loss.float()


if not args.float32:
    torch.set_default_dtype(torch.float64)
world = 1 if args.plain else max(1, num_distrib())
learn = build(args.bs // world)
if args.opt == "sgd":
    learn.opt_func = SGD
steps = StepLosses()
learn.add_cbs([Faults(), Kill(), steps])
if not args.float32:
    learn.model.double()
    learn.add_cb(Float64Batches())
if args.plain:
    learn.fit_one_cycle(args.epochs, 1e-2)
    values = [[float(v) for v in row] for row in learn.recorder.values]
    final = [float(v) for v in learn.validate()]
    preds, targs = learn.get_preds()
else:
    resume = {"checkpoint_every": args.every, "resume": True} if args.every else {}
    freed_in_group: list[bool] = []  # whether the group was alive when the DDP wrapper was freed
    with distrib_ctx(learn, timeout=20, sync_bn=not args.no_sync_bn, **resume):
        if world > 1:
            weakref.finalize(learn.model, lambda: freed_in_group.append(torch.distributed.is_initialized()))
        learn.fit_one_cycle(args.epochs, 1e-2)
        values = [[float(v) for v in row] for row in learn.recorder.values]
        final = [float(v) for v in learn.validate()]  # (a resumed run's recorder holds only its epochs)
        preds, targs = learn.get_preds()
if rank_distrib() == 0:
    torch.save(
        {
            "weights": {k: v.detach().clone() for k, v in learn.model.state_dict().items()},
            "values": values,  # per epoch: train_loss, valid_loss, accuracy
            "final": final,  # validate() on the final weights: valid_loss, accuracy
            "losses": steps.losses,
            "preds": preds.detach().clone(),
            "targs": targs.detach().clone(),
            "ddp_freed_in_group": None if args.plain else freed_in_group,
        },
        args.out,
    )

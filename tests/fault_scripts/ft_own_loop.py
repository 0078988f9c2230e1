"""One torchft replica of a tiny own loop on `unison.Run(fault_tolerant=...)` (or the same training
by the `Learner`), for tests/distributed/test_fault_tolerant_run.py.

TORCHFT_LIGHTHOUSE=http://host:port python ft_own_loop.py --out r0.pt --replica r0 [--die-at 5]
TORCHFT_LIGHTHOUSE=http://host:port python ft_own_loop.py --out r0.pt --replica r0 --learner
unison launch --nproc 2 --start-lighthouse --replica-id a ft_own_loop.py --out a.pt   # rank R: a.pt.rankR

A small MLP scores each of a sample's 5 positions (a third of the labels ignored: the loss is counted
over tokens, unevenly per share; `--loss rows` counts samples instead), in sequential order, global
batch 12 over 121 samples (the last step holds 1 sample: one replica's share of it is empty).
Writes the final weights, what the replica saw (steps redone, where it healed) and every (epoch,
step) its loop body ran to --out, and each step's number to --out + ".step" as it goes.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, DataLoaders, Learner, Run, SummedLoss, set_seed

IGNORE = -100

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--replica", default="")
parser.add_argument("--learner", action="store_true", help="the Learner (a SummedLoss), not an own loop")
parser.add_argument("--loss", default="tokens", choices=["tokens", "rows"])
parser.add_argument("--opt", default="adamw", choices=["adamw", "sgd"])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps mid-step")
parser.add_argument("--die-at", type=int, default=-1, help="SIGKILL itself mid-step at this global step")
parser.add_argument("--min-replicas", type=int, default=1)
parser.add_argument("--start-replicas", type=int, default=2)
parser.add_argument("--timeout", type=float, default=10.0)
parser.add_argument("--hold-at", type=int, default=-1, help="after this global step, wait for --hold-for")
parser.add_argument("--hold-for", default="", help="a file another process writes (its replacement's start)")
parser.add_argument(
    "--sched", action="store_true", help="a OneCycleLR given to run.setup, stepped every body"
)
args = parser.parse_args()
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
out = f"{args.out}.rank{rank}" if world > 1 else args.out  # each rank of a replica group (unison launch)
with open(out + ".started", "w"):  # imports done (what a replacement takes longest for)
    pass


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(121, 5, 8, generator=g)
    y = (x[..., 0] + 0.5 * x[..., 1] > 0).long()
    if args.loss == "tokens":
        y[torch.rand(121, 5, generator=g) < 0.33] = IGNORE
    return TensorDataset(x, y)


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> SummedLoss:
    total = F.cross_entropy(logits.reshape(-1, 2), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return SummedLoss(total, (y != IGNORE).sum() if args.loss == "tokens" else len(y))


bodies = []  # every (epoch, step) the training step's body ran: twice for a redone step
redoing = []  # the (epoch, step) of each pass whose commit failed (`run.redoing` after the backward)


def between_steps(epoch: int, step: int, n_iter: int) -> None:
    """After `--hold-at`, wait (bounded) until `--hold-for` exists: the survivor of a kill then goes on
    only once the replacement has started, so that it is still training when the replacement joins."""
    if epoch * n_iter + step != args.hold_at:
        return
    deadline = time.monotonic() + 120
    while not os.path.exists(args.hold_for) and time.monotonic() < deadline:
        time.sleep(0.05)


def mid_step(epoch: int, step: int, n_iter: int) -> None:
    """Between the loss and the backward pass: sleep (so that a kill lands mid-step), maybe die."""
    bodies.append((epoch, step))
    with open(out + ".step", "w") as fh:
        fh.write(f"{epoch * n_iter + step}\n")
    if args.step_time:
        time.sleep(args.step_time)
    if epoch * n_iter + step == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)  # before its gradient reaches the all-reduce


set_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt_func = torch.optim.AdamW if args.opt == "adamw" else torch.optim.SGD
ft = {"replica_id": args.replica or None, "min_replicas": args.min_replicas}
ft["start_replicas"] = args.start_replicas
train_dl = DataLoader(data(), batch_size=12)

if args.learner:

    class Pace(Callback):
        order = 100

        def after_loss(self) -> None:
            learn = self.learn
            if learn.training:
                mid_step(learn.epoch, learn.iter, learn.n_iter)

    learn = Learner(
        DataLoaders(train_dl, None),
        model,
        token_loss,
        opt_func=opt_func,
        lr=1e-2,
        cbs=[Pace()],
        default_cbs=False,
    )
    with learn.distrib_ctx(fault_tolerant=ft, timeout=args.timeout):
        trainer = learn.strategy
        learn.fit(args.epochs)
    weights = learn.raw_model.state_dict()
else:
    with Run(fault_tolerant=ft, timeout=args.timeout) as run:
        opt = opt_func(model.parameters(), lr=1e-2)
        if args.sched:  # stepped in every body, the failed pass's too: it steps at real steps only
            one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=11 * args.epochs)
            model, opt, sched = run.setup(model, opt, one_cycle)
        else:
            model, opt = run.setup(model, opt)
        trainer = run.host.strategy
        train = run.loader(train_dl)
        for epoch in run.epochs(args.epochs):
            model.train()
            for x, y in train:
                total, count = token_loss(model(x), y)
                loss = run.loss(total, count=count)
                mid_step(epoch, run.batch, len(train))
                run.backward(loss)
                if run.redoing:  # its commit vote failed: this pass's step is skipped, the body runs again
                    redoing.append((epoch, run.batch))
                opt.step()
                opt.zero_grad()
                if args.sched:
                    sched.step()
                between_steps(epoch, run.batch, len(train))
    weights = run.model.state_dict()

state = {
    "weights": {k: v.detach().clone() for k, v in weights.items()},
    "events": dict(trainer.events),
    "bodies": bodies,
    "redoing": redoing,
}
torch.save(state, out + ".tmp")
os.replace(out + ".tmp", out)

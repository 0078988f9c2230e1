"""One torchft replica of a tiny training run (fault-tolerance tests and benchmarks/fault_tolerant.py).

TORCHFT_LIGHTHOUSE=http://host:port python ft_replica.py --out r0.pt --replica r0
python ft_replica.py --out plain.pt --plain        # the uninterrupted one-process reference
unison launch --nproc 2 --lighthouse http://host:port --replica-id a --max-restarts 1 ft_replica.py --out a.pt
                                                   # a replica group of 2: rank R writes a.pt.rankR

Writes the final weights and what the replica saw (steps redone, where it healed) to --out, and
each committed step's number to --out + ".step" (so a test can kill it at a chosen step).
"""

import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from unison import Callback, Checkpoint, DataLoaders, Learner, set_seed

imported = time.time()  # (benchmarks: a replacement's start-up ends here)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--replica", default="")
parser.add_argument("--plain", action="store_true", help="no fault tolerance: the reference run")
parser.add_argument("--ddp", action="store_true", help="plain distrib_ctx() under unison launch (benchmarks)")
parser.add_argument("--batch-size", type=int, default=12)
parser.add_argument("--dir", default=None, help="Checkpoint(every=1) under this folder")
parser.add_argument("--resume", action="store_true", help="fit(resume=True) from --dir's checkpoint")
parser.add_argument("--sampler", action="store_true", help="a batch sampler of uneven, shuffled batches")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps mid-step")
parser.add_argument("--min-replicas", type=int, default=1)
parser.add_argument("--opt", default="adamw", choices=["adamw", "sgd"])
parser.add_argument("--timeout", type=float, default=20.0)
parser.add_argument("--die-at", type=int, default=-1, help="SIGKILL itself mid-step at this step")
parser.add_argument("--die-rank", type=int, default=0, help="which rank of a replica group --die-at kills")
parser.add_argument("--stall-at", type=int, default=-1, help="SIGSTOP itself mid-step at this step")
parser.add_argument("--stream", action="store_true", help="the train set as a sized IterableDataset")
parser.add_argument(
    "--counted", action="store_true", help="the train set writes each index list it loads to --out.fetched"
)
parser.add_argument("--restart-delay", type=float, default=0.0, help="a restarted attempt waits this long")
parser.add_argument("--hold-at", type=int, default=-1, help="after this global step, wait for --hold-for")
parser.add_argument(
    "--hold-for", default="", help="a file another process writes (e.g. its replacement's .asking0)"
)
parser.add_argument("--quorum-interval", type=float, default=None, help="seconds between quorums")
parser.add_argument("--start-replicas", type=int, default=1, help="replicas the first step waits for")
args = parser.parse_args()
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
out = f"{args.out}.rank{rank}" if world > 1 and not args.ddp else args.out  # each rank of a replica group
# Under `unison launch --max-restarts`: only the first attempt dies (the restarted group heals and goes on).
restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
with open(out + ".started", "w"):  # imports done (what a replacement takes longest for)
    pass
dies = rank == args.die_rank and not restarted
if restarted:
    time.sleep(args.restart_delay)  # a machine slower to come back than the others' redo


class Pace(Callback):
    """Sleeps between the loss and the backward pass (so a kill lands mid-step), and writes the
    step count after each optimizer step."""

    order = 100

    def __init__(self):
        self.steps = 0
        self.times = []
        self.n_iter = 0

    def after_loss(self):
        if not self.learn.training:
            return
        if args.step_time:
            time.sleep(args.step_time)
        step = self.learn.epoch * self.learn.n_iter + self.learn.iter
        if dies and step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # before its gradient reaches the all-reduce
        if dies and step == args.stall_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # alive but stuck, until someone continues or kills it

    def after_step(self):
        self.steps += 1
        self.times.append(time.time())  # wall clock: compared across processes
        self.n_iter = self.learn.n_iter  # training steps per epoch
        step = self.learn.epoch * self.learn.n_iter + self.learn.iter
        with open(out + ".step", "w") as fh:
            fh.write(f"{step}\n")
        if step == args.hold_at:  # a survivor goes on once its replacement started (bounded wait)
            deadline = time.monotonic() + 120
            while not os.path.exists(args.hold_for) and time.monotonic() < deadline:
                time.sleep(0.05)


def say_asking():
    """Writes `<out>.asking<restart>` just before the first quorum request (`fit` asks for it before
    its first event): a test's survivors hold until a replacement is this far."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(f"{out}.asking{restart}", "w"):
        pass


class UnevenBatches:
    """Shuffled batches of 7, 12, 10, 5, 7, ... items (a bucketing batch sampler's shape)."""

    def __init__(self, n):
        self.n = n

    def _sizes(self):
        sizes, done, k = [], 0, 0
        while done < self.n:
            sizes.append(min([7, 12, 10, 5][k % 4], self.n - done))
            done, k = done + sizes[-1], k + 1
        return sizes

    def __iter__(self):
        order, start = torch.randperm(self.n).tolist(), 0
        for size in self._sizes():
            yield order[start : start + size]
            start += size

    def __len__(self):
        return len(self._sizes())


class Stream(IterableDataset):
    """The train items as a stream (with a length), reshuffled each epoch by `set_epoch`."""

    def __init__(self, x, y):
        self.x, self.y, self.epoch = x, y, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            yield self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


class Counted(Dataset):
    """The train items, each list of indices this process loads written as a line to --out.fetched."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):  # (torch's fetcher calls it with a batch's indices)
        with open(out + ".fetched", "a") as fh:
            fh.write(" ".join(str(int(i)) for i in indices) + "\n")
        return [(self.x[i], self.y[i]) for i in indices]


def train_loader(x, y):
    if args.counted:
        return DataLoader(Counted(x, y), batch_size=args.batch_size, shuffle=True)
    if args.sampler:
        return DataLoader(TensorDataset(x, y), batch_sampler=UnevenBatches(len(x)))
    if args.stream:
        return DataLoader(Stream(x, y), batch_size=args.batch_size)
    return DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)


set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(240, 8, generator=g)
y = (x[:, 0] + x[:, 1] > 0).long()
dls = DataLoaders(
    train_loader(x[:192], y[:192]),
    DataLoader(TensorDataset(x[192:], y[192:]), batch_size=16),
)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt_func = torch.optim.AdamW if args.opt == "adamw" else torch.optim.SGD
pace = Pace()
cbs = [pace, Checkpoint(every=1)] if args.dir else [pace]
learn = Learner(
    dls,
    model,
    nn.CrossEntropyLoss(),
    opt_func=opt_func,
    lr=1e-2,
    cbs=cbs,
    default_cbs=False,
    path=args.dir or ".",
)
if args.dir:
    learn.add_cb(learn.recorder)  # a checkpoint holds the recorder's state (default_cbs=False leaves it out)
events = {}
started = time.time()
if args.plain:
    learn.fit(args.epochs)
elif args.ddp:
    with learn.distrib_ctx():
        learn.fit(args.epochs)
    if os.environ.get("RANK", "0") != "0":
        raise SystemExit(0)
else:
    ft = {"replica_id": args.replica or None, "min_replicas": args.min_replicas}
    ft["start_replicas"] = args.start_replicas
    if args.quorum_interval is not None:
        ft["quorum_interval"] = args.quorum_interval
    with learn.distrib_ctx(fault_tolerant=ft, timeout=args.timeout):
        trainer = next(cb for cb in learn.cbs if type(cb).__name__ == "FaultTolerantTrainer")
        say_asking()
        learn.fit(args.epochs, resume=args.resume)
        events = dict(trainer.events)
state = {k: v.clone() for k, v in learn.raw_model.state_dict().items()}
torch.save(
    {
        "weights": state,
        "events": events,
        "steps": pace.steps,
        "times": pace.times,
        "started": started,
        "imported": imported,
        "steps_per_epoch": pace.n_iter,
    },
    out + ".tmp",
)
os.replace(out + ".tmp", out)

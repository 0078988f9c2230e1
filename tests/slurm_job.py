"""The training job the real-SLURM tests submit (tests/distributed/test_slurm.py).

    srun python tests/slurm_job.py --results R --bs 8 --opt sgd                 # a task per process
    srun unison launch --nproc-per-node 2 tests/slurm_job.py --results R --bs 8   # a launcher per node
    srun python tests/slurm_job.py --results R --dir D --step-s 0.3 --ready 3   # preemptible

A tiny regression MLP on fixed data (`make_data`, `make_model`: the test builds its plain
one-process reference from them), no shuffling, a `Learner` with SGD or AdamW. At the end every
rank writes `--results` `/<opt>-<attempt>-<rank>.json` (a file: two tasks' long lines interleave
in the job's output): its rank, the world, torch's intra-op thread count, the attempt
(`SLURM_RESTART_COUNT`), and every weight. With `--dir D` it checkpoints every `--every` steps into
D and fits with `resume=True`; each rank appends `<attempt> <global step>` to `D/steps-<rank>`
after each optimizer step (so a test can see that no step was trained twice), and rank 0
writes `D/ready` after step `--ready` (the cue for the test to signal the job); with `--hold` every
rank then waits at that step until its preemption signal has arrived (at most `HOLD_S`), so the
signal lands in training however late a loaded machine delivers it. A preempted rank
prints `STOPPED {"rank": r, "time": t}` (t: wall-clock seconds) before it exits 75.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

N_TRAIN, N_VALID = 64, 16
HOLD_S = 120.0  # --hold: a signal later than this is the test's failure, not a reason to hang


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed inputs and targets: y = x @ w + noise, the first N_TRAIN rows for training."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VALID, 6, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, 6).unsqueeze(1) + 0.1 * torch.randn(N_TRAIN + N_VALID, 1, generator=g)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.1), "adamw": (torch.optim.AdamW, 0.01)}


def main() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from unison import Callback, Checkpoint, DataLoaders, Learner
    from unison.callbacks.preemption import Preempted, Preemption
    from unison.distributed import num_distrib, rank_distrib

    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=8, help="batch size per process")
    parser.add_argument("--opt", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--results", required=True, help="folder for each rank's result file")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dir", help="checkpoint folder; fit(resume=True)")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps")
    parser.add_argument("--ready", type=int, default=-1, help="rank 0 writes DIR/ready after this step")
    parser.add_argument("--hold", action="store_true", help="after step --ready, wait for the signal")
    args = parser.parse_args()
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")

    class Steps(Callback):
        order = 96  # after Checkpoint and Preemption had this step

        def after_step(self) -> None:
            step = self.learn.train_iter  # counted over the run, from 0
            with open(os.path.join(args.dir, f"steps-{rank_distrib()}"), "a") as log:
                log.write(f"{attempt} {step}\n")
            if step == args.ready:
                if rank_distrib() == 0:
                    open(os.path.join(args.dir, "ready"), "w").close()
                if args.hold:
                    self.wait_for_the_signal()
            time.sleep(args.step_s)

        def wait_for_the_signal(self) -> None:
            preemption = next(cb for cb in self.learn.cbs if isinstance(cb, Preemption))
            deadline = time.monotonic() + HOLD_S
            while preemption.received is None and time.monotonic() < deadline:
                time.sleep(0.02)  # the handler runs between two sleeps

    x, y = make_data()
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=args.bs),
        DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=8),
    )
    opt, lr = OPTIMIZERS[args.opt]
    cbs = [Checkpoint(every=args.every), Steps()] if args.dir else []
    learn = Learner(dls, make_model(), nn.MSELoss(), opt_func=opt, lr=lr, cbs=cbs, path=args.dir or ".")
    learn.recorder.print_table = False
    try:
        with learn.distrib_ctx():
            learn.fit(args.epochs, resume=bool(args.dir))
            rank, world = rank_distrib(), num_distrib()
    except Preempted:
        print("STOPPED " + json.dumps({"rank": rank_distrib(), "time": time.time()}), flush=True)
        raise
    weights = [float(v) for p in learn.model.parameters() for v in p.detach().flatten()]
    result = {"rank": rank, "world": world, "threads": torch.get_num_threads(), "attempt": attempt}
    name = os.path.join(args.results, f"{args.opt}-{attempt}-{rank}.json")
    with open(name + ".tmp", "w") as f:
        json.dump({**result, "weights": weights}, f)
    os.replace(name + ".tmp", name)


if __name__ == "__main__":
    main()

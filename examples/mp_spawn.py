"""The PyTorch DDP primer's `mp.spawn` pattern, with `unison.mp_spawn`.

    python examples/mp_spawn.py            # 2 processes, global batch 16

`main_worker(gpu, ...)` runs on every process and, as under `mp.spawn`, gets the process index
first: `mp.spawn(main_worker, nprocs=n, args=(...))` becomes `mp_spawn(main_worker, nprocs=n,
args=(...))`, nothing else changes. (`unison.spawn(fn, nprocs, args)` is the notebook form, without
the index.) It joins the process group either way the primer shows:
- `--init tcp`: the script makes the group itself (`dist.init_process_group("gloo",
  init_method="tcp://...")`); unison uses that group as it is and never tears it down;
- `--init env`: nothing to do, `learn.distrib_ctx()` makes the group from the variables that
  `spawn` set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and removes it afterwards.
Each process takes global batch / processes, every process is seeded the same way with
`set_seed`, and a run resumes from `learn.save` with `learn.load`, mapped to this process's device.

The script trains one epoch with a user-made tcp group and saves it, resumes for a second epoch
under `distrib_ctx`, then checks that every rank holds the same weights and that they equal one
process trained the same way at the global batch (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, set_seed
from unison.distributed import num_distrib
from unison.launch.spawn import mp_spawn

N_TRAIN, N_VALID, FEATURES = 64, 32, 6  # N_TRAIN is a multiple of the global batch: no padding


def make_learner(batch_size: int, path: str, seed: int) -> Learner:
    set_seed(seed)  # the same initial weights and the same data order on every process
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_TRAIN + N_VALID, FEATURES, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    train, valid = TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    dls = DataLoaders(DataLoader(train, batch_size, shuffle=True), DataLoader(valid, batch_size=16))
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    return Learner(dls, model, nn.CrossEntropyLoss(), opt_func=sgd, lr=0.1, path=path)


def flat_weights(learn: Learner) -> torch.Tensor:
    return torch.cat([v.detach().float().flatten() for v in learn.raw_model.state_dict().values()])


def main_worker(
    gpu: int, init: str, port: int, global_batch: int, path: str, seed: int, load: str | None, save: str
):
    """One process's work (`gpu`: its index); returns (on rank 0) every rank's final weights, by rank."""
    if init == "tcp":  # the primer's way: the script makes the group itself, rank = node rank * n + index
        rank, world = 0 * int(os.environ["LOCAL_WORLD_SIZE"]) + gpu, int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    learn = make_learner(global_batch // num_distrib(), path, seed)  # per-process batch
    if load:
        learn.load(load)  # mapped to this process's device (CPU here)
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        learn.fit(1)
        learn.save(save)  # rank 0 writes, atomically; the others wait for it
        weights = learn.collective.gather_objects(flat_weights(learn))
    if init == "tcp":
        assert dist.is_initialized(), "unison must not tear down a group the script made"
        dist.destroy_process_group()
    return weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        # One process at the global batch, the same schedule: one epoch, save, load, one epoch.
        main_worker(0, "none", 0, args.global_batch, f"{path}/one", args.seed, None, "stage1")
        single = main_worker(0, "none", 0, args.global_batch, f"{path}/one", args.seed, "stage1", "final")[0]

        run = (args.global_batch, f"{path}/many", args.seed)
        first = mp_spawn(main_worker, nprocs=args.nprocs, args=("tcp", free_port(), *run, None, "stage1"))
        agree = len(first) == args.nprocs and all(w.equal(first[0]) for w in first)
        print(
            f"epoch 1, group made by the script (tcp://), {args.nprocs} processes x batch "
            f"{args.global_batch // args.nprocs}: ranks agree: {agree}"
        )
        last = mp_spawn(main_worker, nprocs=args.nprocs, args=("env", 0, *run, "stage1", "final"))
        agree = agree and len(last) == args.nprocs and all(w.equal(last[0]) for w in last)
        print(f"epoch 2, resumed from stage1 under distrib_ctx (env://): ranks agree: {agree}")
        diff = float((last[0] - single).abs().max())
        print(f"max |{args.nprocs} processes - 1 process at batch {args.global_batch}| = {diff:.2e}")
    return 0 if agree and diff < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Scaling at 1 to 8 processes: the CNN (exact BatchNorm) and a 50M-parameter MLP, unison beside a
hand-written DDP loop, samples/s and the share of a step spent communicating.

    python benchmarks/scaling.py                          # 1, 2, 4, 8 processes, 1 round; Markdown tables
    python benchmarks/scaling.py --procs 1 2 --repeats 3 --workloads cnn

Every launch is torchrun (gloo, `OMP_NUM_THREADS=1`, one thread per process): on a 2-core
machine 4 and 8 processes oversubscribe the cores, so beyond 2 the figures measure contention
as much as the library. Weak scaling: the per-process batch is fixed (CNN 32, MLP 16), so the
global batch grows with W; samples/s is over the epochs after the first. In each round every
(workload, W) runs the hand-written loop then unison, back to back.

Communication, measured inside the same processes after training:
- gradient all-reduce share: forward+backward steps timed with DDP's all-reduce and under
  `no_sync()`, alternating (CNN 6 x 4 steps each, MLP 3 x 2); 1 minus their ratio. Both peers.
- BatchNorm share (unison's exact BatchNorm, the CNN): the wall time inside its statistics'
  collectives during the timed epochs (`unison.distributed.sync_bn`'s `torch.distributed` calls
  timed, as benchmarks/sync_bn_profile.py does), over the step time; the calls and bytes a step
  sends are counted too: what docs/benchmarks.md projects to a 64-GPU NCCL job from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
CNN_BS, MLP_BS, MLP_STEPS, EPOCHS = 32, 16, 4, int(os.environ.get("EPOCHS", "3"))
PROBE = {"cnn": (6, 4), "mlp50m": (3, 2)}  # the all-reduce probe: alternations, steps each
MLP_GB_PER_PROCESS = 1.6  # 50M params: weights, gradients, DDP buckets, AdamW state, torch itself
PEERS = {"hand": "hand-written DDP loop", "unison": "unison `distrib_ctx()`"}
WORKLOADS = {
    "cnn": "CNN, 2 BatchNorm layers (hand-written: per-rank BN; unison: exact BN, the default)",
    "mlp50m": "MLP, 50.4M parameters (6 residual blocks 1024-4096-1024), AdamW",
}


class BNCalls:
    """`torch.distributed` as unison's sync BatchNorm sees it, its collectives timed and counted."""

    def __init__(self, dist) -> None:
        self._dist, self.s, self.calls, self.bytes = dist, 0.0, 0, 0

    def all_gather_single(self, out, inp, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._dist.all_gather_single(out, inp, *args, **kwargs)
        finally:
            self.s += time.perf_counter() - start
            self.calls += 1
            self.bytes += inp.numel() * inp.element_size()

    def __getattr__(self, name):
        return getattr(self._dist, name)


def _setup(workload: str, world: int):
    """Model, train tensors, optimizer (class, learning rate, options) and per-process batch."""
    import torch

    if workload == "cnn":
        os.environ["WL"] = "conv"
        sys.path.insert(0, str(HERE))
        from workload import data, model

        (x, y), _ = data()
        return model(), x, y, (torch.optim.SGD, 0.05, {"momentum": 0.9}), CNN_BS
    sys.path.insert(0, str(HERE))
    from sharded import DIM, _model

    g = torch.Generator().manual_seed(0)
    n = MLP_BS * world * MLP_STEPS
    x, y = torch.randn(n, DIM, generator=g), torch.randint(0, 10, (n,), generator=g)
    return _model()[0], x, y, (torch.optim.AdamW, 1e-4, {}), MLP_BS


def _grad_share(ddp, opt, loss_func, xb, yb, rounds: int, steps: int) -> float:
    """1 - (forward+backward under no_sync) / (the same with DDP's gradient all-reduce), `rounds`
    alternations of `steps` steps each."""
    import torch.distributed as dist

    timed = {"sync": 0.0, "local": 0.0}
    for _ in range(rounds):
        for mode in timed:
            dist.barrier()
            start = time.perf_counter()
            with ddp.no_sync() if mode == "local" else contextlib.nullcontext():
                for _ in range(steps):
                    opt.zero_grad(set_to_none=True)
                    loss_func(ddp(xb), yb).backward()
            timed[mode] += time.perf_counter() - start
    return max(0.0, 1 - timed["local"] / timed["sync"])


def _report(peer: str, workload: str, times: list[float], steps: int, bs: int, extra: dict) -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    if dist.get_rank() == 0:
        steady = sum(times[1:])
        out = {"peer": peer, "workload": workload, "world": world}
        out["samples_per_s"] = (len(times) - 1) * steps * bs * world / steady
        out["step_ms"] = 1e3 * steady / ((len(times) - 1) * steps)
        print("RESULT " + json.dumps({**out, **extra}), flush=True)


def hand_worker(workload: str) -> None:
    """The hand-written loop: DDP, DistributedSampler, per-rank BatchNorm (as run.py's raw_ddp.py)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, y, (opt_class, lr, options), bs = _setup(workload, dist.get_world_size())
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=bs, sampler=sampler)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt, loss_func = opt_class(ddp.parameters(), lr=lr, **options), nn.CrossEntropyLoss()
    times = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for xb, yb in dl:
            opt.zero_grad(set_to_none=True)
            loss_func(ddp(xb), yb).backward()
            opt.step()
        times.append(time.perf_counter() - start)
    xb, yb = next(iter(dl))
    share = _grad_share(ddp, opt, loss_func, xb, yb, *PROBE[workload]) if dist.get_world_size() > 1 else 0.0
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _report("hand", workload, times, len(dl), bs, {"grad_share": share, "grad_bytes": grad_bytes})
    dist.destroy_process_group()


def unison_worker(workload: str) -> None:
    """The same training with unison's Learner (exact BatchNorm by default)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import unison.distributed.sync_bn as sync_bn
    from unison import Callback, DataLoaders, Learner
    from unison.distributed import num_distrib

    torch.set_num_threads(1)
    model, x, y, (opt_class, lr, options), bs = _setup(workload, num_distrib())
    bn = BNCalls(sync_bn.dist)
    sync_bn.dist = bn  # instrumentation only: counts and times exact BatchNorm's collectives

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.bn: list[tuple[float, int, int]] = []

        def before_train(self) -> None:
            self._start, self._bn = time.perf_counter(), (bn.s, bn.calls, bn.bytes)

        def after_train(self) -> None:
            self.times.append(time.perf_counter() - self._start)
            self.bn.append((bn.s - self._bn[0], bn.calls - self._bn[1], bn.bytes - self._bn[2]))

    measure = Measure()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True), None)
    opt_func = partial(opt_class, **options)
    learn = Learner(dls, model, nn.CrossEntropyLoss(), opt_func=opt_func, lr=lr, cbs=[measure])
    learn.recorder.print_table = False
    with learn.distrib_ctx():
        learn.fit(EPOCHS)
        steps = learn.n_iter  # this rank's batches per epoch
        timed_steps = (len(measure.times) - 1) * steps
        bn_s = sum(b[0] for b in measure.bn[1:])
        extra = {
            "bn_share": bn_s / sum(measure.times[1:]),
            "bn_calls_per_step": sum(b[1] for b in measure.bn[1:]) / timed_steps,
            "bn_bytes_per_step": sum(b[2] for b in measure.bn[1:]) / timed_steps,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
        share = 0.0
        if num_distrib() > 1:
            probe = (learn.model, learn.opt, nn.CrossEntropyLoss(), x[:bs], y[:bs], *PROBE[workload])
            share = _grad_share(*probe)
        extra["grad_share"] = share
        _report("unison", workload, measure.times, steps, bs, extra)
        dist.barrier()


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def launch(peer: str, workload: str, world: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [__file__, "--worker", peer, "--workload", workload]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    found = re.findall(r"RESULT (\{.*\})", proc.stdout)
    if not found:
        raise RuntimeError(f"{peer} {workload} W={world} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[0])


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def tables(runs: dict, procs: list[int], skipped: dict) -> str:
    lines = []
    for workload, title in WORKLOADS.items():
        if not any(k[0] == workload for k in runs):
            continue
        lines += [
            "",
            f"{title}:",
            "",
            "| W | peer | samples/s | efficiency | step ms | gradient all-reduce share "
            "| exact-BN collectives share | BN calls, bytes a rank sends per step | unison / hand-written |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for w in procs:
            if (workload, w) in skipped:
                lines.append(f"| {w} | both | skipped: {skipped[workload, w]} | | | | | | |")
                continue
            for peer, label in PEERS.items():
                r = runs[workload, w][peer]
                one = runs.get((workload, 1), {}).get(peer)
                eff = f"{_med(r, 'samples_per_s') / (w * _med(one, 'samples_per_s')):.2f}" if one else "-"
                grad = f"{_med(r, 'grad_share'):.0%}" if w > 1 else "-"
                bn = f"{_med(r, 'bn_share'):.0%}" if peer == "unison" and w > 1 else "-"
                calls = "-"
                if peer == "unison" and workload == "cnn":
                    calls = f"{_med(r, 'bn_calls_per_step'):.0f}, {_med(r, 'bn_bytes_per_step'):.0f} B"
                vs = "1"
                if peer == "unison":
                    hand = runs[workload, w]["hand"]
                    ratio = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(r, hand, strict=True)]
                    vs = f"{statistics.median(ratio):.3f}"
                lines.append(
                    f"| {w} | {label} | {_med(r, 'samples_per_s'):.1f} | {eff} | {_med(r, 'step_ms'):.1f} "
                    f"| {grad} | {bn} | {calls} | {vs} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=tuple(PEERS))
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="cnn")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        (hand_worker if args.worker == "hand" else unison_worker)(args.workload)
        return
    load_start = os.getloadavg()
    runs: dict = {}
    skipped: dict = {}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for i in range(args.repeats):
        for workload in args.workloads:
            for w in args.procs:
                need = MLP_GB_PER_PROCESS * w if workload == "mlp50m" else 0.5 * w
                if need > _mem_available_gb() - 2:
                    skipped[workload, w] = f"needs ~{need:.0f} GB, {_mem_available_gb():.0f} GB available"
                    continue
                cell = runs.setdefault((workload, w), {p: [] for p in PEERS})
                for peer in PEERS:  # back to back: load drift hits both alike
                    cell[peer].append(launch(peer, workload, w))
                    r = cell[peer][-1]
                    print(
                        f"round {i + 1} {workload} W={w} {peer}: {r['samples_per_s']:.1f} samples/s",
                        flush=True,
                    )
    load_end = os.getloadavg()
    head = (
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
        f"{__import__('torch').__version__}, gloo, torchrun, 1 thread per process; {started} UTC, "
        f"{args.repeats} round(s), medians. Load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{v:.1f}" for v in load_start)
        + "; at the end: "
        + ", ".join(f"{v:.1f}" for v in load_end)
        + f". Beyond {os.cpu_count()} processes the cores are oversubscribed."
    )
    print("\n" + head + "\n" + tables(runs, args.procs, skipped))


if __name__ == "__main__":
    main()

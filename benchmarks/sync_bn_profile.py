"""Where exact BatchNorm's time goes: the benchmark CNN's step, per-rank vs exact BatchNorm, in one group.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/sync_bn_profile.py
    ROUNDS=40 python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/sync_bn_profile.py

The same processes and process group train four DDP copies of the CNN of benchmarks/workload.py
(per-rank or exact BatchNorm, DDP's per-forward buffer broadcast on or off), 8 steps each in
turn, for ROUNDS rounds (the first not counted), so that load changes hit all four alike. Rank 0
prints, per copy, the median step time and its minimum, and the wall time per step spent inside
the BatchNorm statistics' collectives (timed around `torch.distributed`'s functions: on a busy
machine mostly waiting for the other rank to be scheduled, not moving the ~1.5 KB they carry).
First it times single small collectives (the sizes the statistics need), 40 rounds of 20 calls.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WL", "conv")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from workload import model  # noqa: E402

import unison.distributed.sync_bn as sync_bn  # noqa: E402

BS, STEPS = 32, 8
in_collectives = {"s": 0.0}


def timed(fn):
    """`fn`, adding the wall time of each call to `in_collectives` (instrumentation only)."""

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            in_collectives["s"] += time.perf_counter() - start

    return call


class TimedDist:
    """`torch.distributed` as sync_bn sees it, with its collectives timed."""

    all_gather_single = staticmethod(timed(dist.all_gather_single))
    all_reduce = staticmethod(timed(dist.all_reduce))

    def __getattr__(self, name):
        return getattr(dist, name)


def latency(rounds: int = 40, calls: int = 20) -> None:
    """One small collective's round trip on this group: the sizes the CNN's C = 64 layer sends."""
    world = dist.get_world_size()
    stats, out, sums = torch.randn(129), torch.empty(world * 129), torch.randn(128)
    ops = {
        "all_gather_single, 129 floats (forward)": lambda: dist.all_gather_single(out, stats),
        "all_reduce, 128 floats (backward)": lambda: dist.all_reduce(sums),
        "barrier": dist.barrier,
    }
    took: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                op()
            took[name].append((time.perf_counter() - start) / calls * 1e6)
    if dist.get_rank() == 0:
        print(f"| one collective, {world} processes | median us | min us |")
        print("| --- | ---: | ---: |")
        for name, t in took.items():
            print(f"| {name} | {statistics.median(t):.0f} | {min(t):.0f} |")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    latency()
    sync_bn.dist = TimedDist()
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(BS, 3, 32, 32, generator=g) for _ in range(STEPS)]
    ys = [torch.randint(0, 10, (BS,), generator=g) for _ in range(STEPS)]

    def make(exact: bool, broadcast: bool):
        m = sync_bn.convert_sync_batchnorm(model()) if exact else model()
        m = nn.parallel.DistributedDataParallel(m, forward_sync_buffers=broadcast, bucket_cap_mb=100)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    copies = {
        "per-rank BN, buffer broadcast (as hand-written)": make(False, True),
        "per-rank BN, no broadcast": make(False, False),
        "exact BN, buffer broadcast (unison before)": make(True, True),
        "exact BN, no broadcast (unison now)": make(True, False),
    }
    loss_func = nn.CrossEntropyLoss()
    steps: dict[str, list[float]] = {k: [] for k in copies}
    waits: dict[str, list[float]] = {k: [] for k in copies}
    for i in range(int(os.environ.get("ROUNDS", "12"))):
        for name, (m, opt) in copies.items():
            dist.barrier()
            in_collectives["s"] = 0.0
            start = time.perf_counter()
            for x, y in zip(xs, ys, strict=True):
                opt.zero_grad(set_to_none=True)
                loss_func(m(x), y).backward()
                opt.step()
            if i > 0:
                steps[name].append((time.perf_counter() - start) / STEPS)
                waits[name].append(in_collectives["s"] / STEPS)
    if dist.get_rank() == 0:
        print(
            f"| 2 processes x 1 thread, {len(steps[name])} rounds | step ms (median) | step ms (min) "
            "| in BN collectives ms/step |"
        )
        print("| --- | ---: | ---: | ---: |")
        for name in copies:
            s, w = steps[name], waits[name]
            print(
                f"| {name} | {statistics.median(s) * 1e3:.1f} | {min(s) * 1e3:.1f} | "
                f"{statistics.median(w) * 1e3:.1f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

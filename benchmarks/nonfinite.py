"""Cost of the non-finite check (`Learner(on_nonfinite="stop")`, the default) on training speed.

Each configuration starts its processes once (`unison.spawn`) and, in the same processes and
process group, trains one epoch with the check and one without, alternating which goes first,
`--rounds` times after a warm-up epoch of each. A round's ratio is (time with) / (time
without), in rank 0's CPU time (the process's, all threads: what the check adds, and little
moved by other jobs on a shared machine) and in wall time; the table gives the medians of the
rounds' ratios, the CPU ratios' range, and the check's own CPU time per step (its `after_loss`
and `before_step`, timed in the runs with it).

    python benchmarks/nonfinite.py                     # prints the Markdown table for RESULTS.md
    python benchmarks/nonfinite.py --rounds 15 --steps 40 --only mlp
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WORKLOADS = {
    # (inputs, hidden sizes, per-process batch): overhead-bound, and gradient-bytes-bound
    "mlp": (64, (512, 512), 32),
    "wide": (256, (2048, 2048, 2048), 64),
}


def _model(workload: str) -> nn.Module:
    n_in, hidden, _ = WORKLOADS[workload]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    return nn.Sequential(*layers, nn.Linear(n_in, 10))


class _Timed:
    """Wraps a callback method, summing its CPU time (this thread's)."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self):
        start = time.thread_time()
        try:
            self.fn()
        finally:
            self.total += time.thread_time() - start


def _worker(workload: str, shard: bool, rounds: int, steps: int) -> dict:
    from unison import Callback, DataLoaders, Learner
    from unison.callbacks.nonfinite import NonFiniteCheck
    from unison.distributed import num_distrib

    torch.set_num_threads(1)
    world = num_distrib()
    n_in, _, bs = WORKLOADS[workload]
    n = steps * bs * world
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, n_in, generator=g), torch.randint(0, 10, (n,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs), None)

    class TrainTime(Callback):
        def before_train(self):
            self.start = (time.process_time(), time.perf_counter())

        def after_train(self):
            self.seconds = (time.process_time() - self.start[0], time.perf_counter() - self.start[1])

    timer = TrainTime()
    opt = partial(torch.optim.SGD, momentum=0.9)
    learn = Learner(dls, _model(workload), nn.CrossEntropyLoss(), opt_func=opt, lr=1e-3, cbs=[timer])
    learn.recorder.print_table = False
    check = learn.get_cb(NonFiniteCheck)
    hooks = {"after_loss": _Timed(check.after_loss), "before_step": _Timed(check.before_step)}
    for name, hook in hooks.items():
        setattr(check, name, hook)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}

    def epoch(with_check: bool) -> tuple[float, float]:
        learn.remove_cb(check)
        if with_check:
            learn.add_cb(check)
        learn.fit(1)
        return timer.seconds

    with learn.distrib_ctx(shard=shard):
        epoch(True), epoch(False)  # warm-up
        for hook in hooks.values():
            hook.total = 0.0
        for r in range(rounds):
            for with_check in (True, False) if r % 2 == 0 else (False, True):
                times[with_check].append(epoch(with_check))
    params = sum(p.numel() for p in learn.model.parameters())
    check_s = sum(h.total for h in hooks.values()) / (rounds * steps)
    return {"on": times[True], "off": times[False], "check_s": check_s, "params": params, "world": world}


def main() -> None:
    from unison import spawn

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed epoch")
    parser.add_argument("--only", choices=sorted(WORKLOADS), help="one workload")
    args = parser.parse_args()
    configs = [("1 process", 1, False), ("2 processes, DDP", 2, False), ("2 processes, sharded", 2, True)]
    rows = []
    for workload in [args.only] if args.only else list(WORKLOADS):
        for label, nprocs, shard in configs:
            print(f"{workload}, {label} ...", file=sys.stderr, flush=True)
            got = spawn(_worker, nprocs, args=(workload, shard, args.rounds, args.steps))
            pairs = list(zip(got["on"], got["off"], strict=True))
            cpu = [on[0] / off[0] for on, off in pairs]
            wall = [on[1] / off[1] for on, off in pairs]
            step_ms = statistics.median(off[0] for _, off in pairs) / args.steps * 1e3
            rows.append(
                f"| {workload} ({got['params'] / 1e6:.2f}M params) | {label} | {step_ms:.2f} | "
                f"{got['check_s'] * 1e6:.0f} us ({got['check_s'] * 1e3 / step_ms * 100:.1f}%) | "
                f"**{statistics.median(cpu):.3f}** | {min(cpu):.3f} - {max(cpu):.3f} | "
                f"{statistics.median(wall):.3f} |"
            )
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, gloo; {args.rounds} interleaved rounds of {args.steps} steps, "
        "1 thread per process; times are rank 0's.\n"
    )
    print(
        "| workload | processes | CPU ms per step, no check | check's CPU per step | with / without, CPU "
        "(median) | CPU range | with / without, wall (median) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

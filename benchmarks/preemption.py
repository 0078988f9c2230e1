"""Cost of preemption handling (`Learner(on_preempt="stop")`, the default) on training speed.

What it adds per optimizer step: on W > 1 processes, one all-reduce of one float64 (the ranks
agree whether any got the signal); on one process, a read of a flag. Each configuration starts its
processes once (`unison.spawn`) and, in the same processes and process group, trains one epoch
with the `Preemption` callback and one without, alternating which goes first, `--rounds` times
after a warm-up epoch of each. A round's ratio is (time with) / (time without), wall and rank 0's
CPU time; the table gives the medians of the rounds' ratios and their range, and the callback's
own wall time per step (its `after_batch`, which holds the all-reduce).

    python benchmarks/preemption.py                     # prints the Markdown table for RESULTS.md
    python benchmarks/preemption.py --rounds 15 --steps 40
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

N_IN, HIDDEN, BS = 64, (512, 512), 32  # small and overhead-bound: the worst case for a per-step cost


class _Timed:
    """Wraps a callback method, summing its wall time."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self):
        start = time.perf_counter()
        try:
            self.fn()
        finally:
            self.total += time.perf_counter() - start


def _worker(rounds: int, steps: int) -> dict:
    from unison import Callback, DataLoaders, Learner
    from unison.callbacks.preemption import Preemption
    from unison.distributed import num_distrib

    torch.set_num_threads(1)
    world = num_distrib()
    n = steps * BS * world
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, N_IN, generator=g), torch.randint(0, 10, (n,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), None)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width_in = N_IN
    for width in HIDDEN:
        layers += [nn.Linear(width_in, width), nn.ReLU()]
        width_in = width
    model = nn.Sequential(*layers, nn.Linear(width_in, 10))

    class TrainTime(Callback):
        def before_train(self):
            self.start = (time.process_time(), time.perf_counter())

        def after_train(self):
            self.seconds = (time.process_time() - self.start[0], time.perf_counter() - self.start[1])

    timer = TrainTime()
    opt = partial(torch.optim.SGD, momentum=0.9)
    learn = Learner(dls, model, nn.CrossEntropyLoss(), opt_func=opt, lr=1e-3, cbs=[timer])
    learn.recorder.print_table = False
    preempt = learn.get_cb(Preemption)
    hook = _Timed(preempt.after_batch)
    preempt.after_batch = hook
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}

    def epoch(with_it: bool) -> tuple[float, float]:
        learn.remove_cb(preempt)
        if with_it:
            learn.add_cb(preempt)
        learn.fit(1)
        return timer.seconds

    with learn.distrib_ctx():
        epoch(True), epoch(False)  # warm-up
        hook.total = 0.0
        for r in range(rounds):
            for with_it in (True, False) if r % 2 == 0 else (False, True):
                times[with_it].append(epoch(with_it))
    return {"on": times[True], "off": times[False], "hook_s": hook.total / (rounds * steps), "world": world}


def main() -> None:
    from unison import spawn

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per timed epoch")
    args = parser.parse_args()
    rows = []
    for label, nprocs in (("1 process", 1), ("2 processes, DDP", 2)):
        print(f"{label} ...", file=sys.stderr, flush=True)
        got = spawn(_worker, nprocs, args=(args.rounds, args.steps))
        pairs = list(zip(got["on"], got["off"], strict=True))
        wall = [on[1] / off[1] for on, off in pairs]
        cpu = [on[0] / off[0] for on, off in pairs]
        step_ms = statistics.median(off[1] for _, off in pairs) / args.steps * 1e3
        hook_us = got["hook_s"] * 1e6
        rows.append(
            f"| {label} | {step_ms:.2f} | {hook_us:.0f} us ({hook_us / 1e3 / step_ms * 100:.1f}%) | "
            f"**{statistics.median(wall):.3f}** | {min(wall):.3f} - {max(wall):.3f} | "
            f"{statistics.median(cpu):.3f} |"
        )
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, gloo; MLP 64-512-512-10, batch {BS} per process; {args.rounds} "
        f"interleaved rounds of {args.steps} steps, 1 thread per process; times are rank 0's.\n"
    )
    print(
        "| processes | wall ms per step, without | the callback's wall time per step | with / without, "
        "wall (median) | wall range | with / without, CPU (median) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

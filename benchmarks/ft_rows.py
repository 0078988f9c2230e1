"""What a torchft replica spends loading a step: its rows only (`unison.distributed.ft_rows`, the
default) beside the whole global batch (`fault_tolerant={"fetch_rows": False}`, the old way), with
1, 2 and 3 replicas, nothing failing.

    python benchmarks/ft_rows.py                       # 3 interleaved rounds; updates its RESULTS.md section
    python benchmarks/ft_rows.py --rounds 1 --no-write

A map-style dataset whose `__getitem__` spins a fixed CPU time (`--item-ms`, 1 ms: thread time, so
the figure does not count the other processes' turns on the cores), 960 items in global batches
of 24 (40 steps), a small MLP, AdamW, one torch thread per process. Data time of a step: from the
end of the step before to the step's `before_batch` (the loader's fetch and collate, as the loop
waits for them), in wall time and in the main thread's CPU time (what the fetch itself costs,
whatever else runs on the cores), median over the steps after the first 5, then over the
replicas. Each round runs every (replicas, mode) once, the modes alternating first; the table
gives each one's median over the rounds. Replicas are processes on this machine with a
lighthouse in this one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTION = "## A torchft replica loads only its rows (`python benchmarks/ft_rows.py`)"


def replica_main(args: argparse.Namespace) -> None:
    """One replica: trains 40 steps and writes each step's data time (seconds) to --out."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from unison import Callback, DataLoaders, Learner, set_seed

    class Costly(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 2, (n,), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):
            done = time.thread_time() + args.item_ms / 1000  # a decode or augmentation's CPU time
            while time.thread_time() < done:
                pass
            return self.x[i], self.y[i]

    class DataClock(Callback):
        order = -40  # before the fault-tolerant trainer's before_batch (its quorum is not data time)

        def __init__(self) -> None:
            self.last, self.times = None, []

        def before_batch(self) -> None:
            if self.learn.training and self.last is not None:
                wall, cpu = self.last
                self.times.append((time.perf_counter() - wall, time.thread_time() - cpu))

        def after_batch(self) -> None:
            self.last = (time.perf_counter(), time.thread_time())

    set_seed(0)
    dls = DataLoaders(DataLoader(Costly(960), batch_size=24, shuffle=True), None)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    clock = DataClock()
    loss, adamw = nn.CrossEntropyLoss(), torch.optim.AdamW
    learn = Learner(dls, model, loss, opt_func=adamw, cbs=[clock], default_cbs=False)
    options = {"replica_id": args.replica, "min_replicas": args.replicas, "start_replicas": args.replicas}
    options["fetch_rows"] = None if args.mode == "rows" else False
    with learn.distrib_ctx(fault_tolerant=options, timeout=20):
        learn.fit(1)
    Path(args.out).write_text(json.dumps(clock.times))


def one_run(replicas: int, mode: str, item_ms: float, tmp: Path) -> tuple[float, float]:
    """The median data time of a step (ms), wall and the main thread's CPU, of `replicas` replicas
    loading in `mode`."""
    from unison.distributed.fault_tolerant import LIGHTHOUSE_ENV, start_lighthouse

    lighthouse = start_lighthouse(min_replicas=replicas, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {**os.environ, LIGHTHOUSE_ENV: lighthouse.address(), "OMP_NUM_THREADS": "1"}
    try:
        procs, outs = [], []
        for r in range(replicas):
            out = tmp / f"{mode}-{replicas}-r{r}.json"
            cmd = [sys.executable, __file__, "--replica-run", "--replica", f"r{r}", "--out", str(out)]
            cmd += ["--replicas", str(replicas), "--mode", mode, "--item-ms", str(item_ms)]
            log = open(f"{out}.log", "w")  # noqa: SIM115  (closed when the process is done)
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
            outs.append(out)
        for proc, log in procs:
            code = proc.wait(timeout=300)
            log.close()
            if code != 0:
                raise RuntimeError(f"replica failed:\n{Path(log.name).read_text()[-3000:]}")
    finally:
        lighthouse.shutdown()
    steps = [json.loads(o.read_text())[5:] for o in outs]
    wall = statistics.median(statistics.median(w for w, _ in s) for s in steps)
    cpu = statistics.median(statistics.median(c for _, c in s) for s in steps)
    return 1000 * wall, 1000 * cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--item-ms", type=float, default=1.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--replica-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replica", default="r0", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="rows", choices=["rows", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica_run:
        replica_main(args)
        return
    got: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for round_ in range(args.rounds):
            modes = ["rows", "whole"] if round_ % 2 == 0 else ["whole", "rows"]
            for replicas in (1, 2, 3):
                for mode in modes:
                    wall, cpu = one_run(replicas, mode, args.item_ms, Path(d))
                    got.setdefault((replicas, mode), []).append((wall, cpu))
                    said = f"{wall:.1f} ms wall, {cpu:.1f} ms CPU"
                    print(f"round {round_ + 1}: {replicas} replica(s), {mode}: {said}", flush=True)
    load = os.getloadavg()[0]
    lines = [
        f"{args.rounds} interleaved rounds, {platform.node()} ({os.cpu_count()} cores, load average "
        f"{load:.0f} at the end), {args.item_ms:g} ms of CPU per item, global batch 24; data time "
        "per step, median over the rounds (ms), wall and the main thread's CPU; the ratio of the "
        "wall medians, and its range over the rounds:",
        "",
        "| replicas | whole batch (before): wall, CPU | its rows only: wall, CPU | wall ratio (min-max) |",
        "|---:|---:|---:|---:|",
    ]
    for replicas in (1, 2, 3):
        whole, rows = got[(replicas, "whole")], got[(replicas, "rows")]
        w_wall, w_cpu = (statistics.median(x[i] for x in whole) for i in (0, 1))
        r_wall, r_cpu = (statistics.median(x[i] for x in rows) for i in (0, 1))
        ratios = [r[0] / w[0] for r, w in zip(rows, whole, strict=True)]
        lines.append(
            f"| {replicas} | {w_wall:.1f}, {w_cpu:.1f} | {r_wall:.1f}, {r_cpu:.1f} | "
            f"{r_wall / w_wall:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text)


def write_section(text: str) -> None:
    """Replace (or append) this benchmark's section of benchmarks/RESULTS.md."""
    results = HERE / "RESULTS.md"
    old = results.read_text() if results.exists() else ""
    start = old.find(SECTION)
    if start < 0:
        results.write_text(old.rstrip("\n") + f"\n\n{SECTION}\n\n{text}\n")
        return
    end = old.find("\n## ", start + len(SECTION))
    rest = old[end:] if end >= 0 else "\n"
    results.write_text(old[:start] + f"{SECTION}\n\n{text}\n" + rest)


if __name__ == "__main__":
    main()

"""nanoGPT's speed: the torchrun original against its port to `unison.Run`, interleaved rounds.

Both scripts (examples/nanogpt/) train the same tiny character-level GPT on 2 processes (gloo, one
thread each) with the same work per process and iteration: 2 micro-batches of 8 windows of 64
characters, one gradient all-reduce, clipping, AdamW. The original is started as people start it
(`torchrun --standalone --nproc_per_node 2`, `--gradient_accumulation_steps 4`, which nanoGPT
divides by the 2 processes), the port as the docs start it (`unison launch --nproc 2`,
`--gradient_accumulation_steps 2` per process). Each prints nanoGPT's `iter N: loss L, time T ms`
line on rank 0 (the wall time of that iteration); the first `--skip` iterations (start-up, the
evaluation at iteration 0, the allocator's first steps) are left out, and a run's figure is the
median of the rest (and of their CPU times: rank 0's own, which a loaded machine disturbs far
less than the wall time). Rounds alternate original, port, original, port ... so that drift in the
machine's load hits both alike; the report gives the medians over rounds, the median of the
rounds' ratios (original ms / port ms: the port's speed as a fraction of the original's, 1.0 =
as fast), and the load average before and after.

    python benchmarks/nanogpt_speed.py                      # 7 rounds of 100 iterations
    python benchmarks/nanogpt_speed.py --rounds 5 --iters 60 --skip 10
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "nanogpt"
ITER_LINE = re.compile(r"iter (\d+): loss [-\d.naninf]+, time ([\d.]+)ms, cpu ([\d.]+)ms")


def commands(nproc: int, iters: int) -> dict[str, list[str]]:
    """The two launches, with the same work per process and iteration."""
    common = ["--batch_size", "8", "--max_iters", str(iters), "--eval_interval", str(iters)]
    original = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    original += [str(EXAMPLE / "train_torchrun.py"), *common, "--gradient_accumulation_steps", str(2 * nproc)]
    port = [sys.executable, "-m", "unison.launch", "--nproc", str(nproc), str(EXAMPLE / "train.py")]
    port += [*common, "--gradient_accumulation_steps", "2"]
    return {"torchrun original": original, "unison port": port}


def one_run(cmd: list[str], out_dir: Path, skip: int) -> tuple[float, float, float, int]:
    """Medians of rank 0's wall and CPU ms per iteration after `skip`, the launch's wall seconds, and
    the iterations kept."""
    cmd = [*cmd, "--out_dir", str(out_dir)]  # a fresh folder (the port would resume a finished run)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=out_dir.parent)
    wall = time.perf_counter() - start
    found = [(float(ms), float(cpu)) for it, ms, cpu in ITER_LINE.findall(proc.stdout) if int(it) >= skip]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    times, cpus = zip(*found, strict=True)
    return statistics.median(times), statistics.median(cpus), wall, len(found)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} (min-max {min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=100, help="iterations per run")
    parser.add_argument("--skip", type=int, default=10, help="first iterations left out of each run")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results: dict[str, list[tuple[float, float, float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="nanogpt-speed-") as tmp:
        for r in range(args.rounds):
            for label, cmd in commands(args.nproc, args.iters).items():
                out_dir = Path(tmp) / f"r{r}" / label.split()[0]
                out_dir.parent.mkdir(parents=True, exist_ok=True)
                results.setdefault(label, []).append(one_run(cmd, out_dir, args.skip))
                ms, cpu, wall, kept = results[label][-1]
                print(
                    f"round {r + 1}/{args.rounds} {label}: {ms:.2f} ms/iteration, {cpu:.2f} ms CPU "
                    f"(medians of {kept}), launch {wall:.1f} s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    load_after = os.getloadavg()
    (orig_label, orig), (port_label, port) = results.items()
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, gloo, {args.nproc} processes x 1 thread; "
        f"{args.rounds} interleaved rounds of {args.iters} iterations, the first {args.skip} of each left out"
    )
    loads = [", ".join(f"{v:.1f}" for v in load) for load in (load_before, load_after)]
    print(f"load average (1, 5, 15 min): before {loads[0]}; after {loads[1]}")
    print("| script | ms/iteration, median (min-max of rounds) | CPU ms/iteration (rank 0) | launch s |")
    print("| --- | ---: | ---: | ---: |")
    for label, rows in results.items():
        ms, cpu, wall = ([row[k] for row in rows] for k in range(3))
        print(
            f"| {label} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | "
            f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | {statistics.median(wall):.1f} |"
        )
    speed = [o[0] / p[0] for o, p in zip(orig, port, strict=True)]
    cpu_speed = [o[1] / p[1] for o, p in zip(orig, port, strict=True)]
    print(
        f"{port_label} / {orig_label}, median of the rounds' ratios (goal >= 0.98): "
        f"speed (original ms / port ms) **{spread(speed)}**; CPU time per iteration, "
        f"original / port: **{spread(cpu_speed)}**"
    )


if __name__ == "__main__":
    main()

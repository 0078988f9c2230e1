"""Sharded (FSDP2) vs DDP: memory per rank and throughput, a 50M-parameter model on 2 CPU processes.

    python benchmarks/sharded.py               # 2 interleaved rounds; updates its section of RESULTS.md
    python benchmarks/sharded.py --repeats 1 --no-write

Each round launches `unison launch --nproc 2 benchmarks/sharded.py --worker MODE` for the
modes ddp, shard and shard-keep: the same model, data, global batch and AdamW, with
`distrib_ctx()`, `distrib_ctx(shard=True)` or `distrib_ctx(shard=True,
reshard_after_forward=False)`, under a fixed malloc mmap threshold; then ddp, shard and
shard with `release_memory=False` once more without that variable. Each rank reports,
right after an optimizer step (when weights, gradients and optimizer state all exist),
the bytes of the parameters, gradients and optimizer state it holds, and its peak RSS;
rank 0 reports training samples/s over the epochs after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- sharded-benchmark:begin -->", "<!-- sharded-benchmark:end -->"
DIM, HIDDEN, BLOCKS, BS, STEPS, EPOCHS = 1024, 4096, 6, 16, 6, 3
MODES = ("ddp", "shard", "shard-keep")  # shard-keep: reshard_after_forward=False
# glibc raises its mmap threshold to the size of freed blocks (up to 32 MB), after which
# freed weight-sized buffers stay in the heap and in RSS; a fixed threshold returns them.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def worker(mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from unison import Callback, DataLoaders, Learner, set_seed
    from unison.distributed import num_distrib

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    class Measure(Callback):
        def __init__(self) -> None:
            self.held: dict[str, int] = {}
            self.times: list[float] = []

        def before_train(self) -> None:
            self._start = time.perf_counter()

        def after_train(self) -> None:
            self.times.append(time.perf_counter() - self._start)

        def after_step(self) -> None:  # before zero_grad: weights, gradients and optimizer state all live
            learn = self.learn
            params = list(learn.model.parameters())
            state = [v for s in learn.opt.state.values() for v in s.values() if torch.is_tensor(v)]
            held = {
                "params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
                "opt": sum(local_bytes(v) for v in state),
            }
            held["total"] = sum(held.values())
            self.held = max(self.held, held, key=lambda h: h.get("total", 0))

    set_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(DIM, 10))
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    n = BS * 2 * STEPS
    x, y = torch.randn(n, DIM, generator=g), torch.randint(0, 10, (n,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True), None)
    measure = Measure()
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-4, cbs=[measure])
    learn.recorder.print_table = False
    options: dict = {}
    if mode != "ddp":
        options = {"shard": True, "reshard_after_forward": mode != "shard-keep"}
        options["release_memory"] = mode != "shard-hold"
    with learn.distrib_ctx(**options):
        learn.fit(EPOCHS)
        world = num_distrib()
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        everyone = [None] * world
        dist.all_gather_object(everyone, {"held": measure.held, "rss_mb": rss_mb})
        rank = dist.get_rank()
    if rank == 0:
        steady = sum(measure.times[1:])
        result = {
            "mode": mode,
            "params": n_params,
            "world": world,
            "samples_per_s": (EPOCHS - 1) * n / steady,
            "ranks": everyone,
        }
        print("RESULT " + json.dumps(result), flush=True)


def launch(mode: str, malloc_env: dict[str, str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **malloc_env}
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", "2", __file__, "--worker", mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    found = re.findall(r"RESULT (\{.*\})", proc.stdout)
    if proc.returncode != 0 or not found:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{tail}")
    return json.loads(found[0])


def table(runs: dict[str, list[dict]], default_malloc: dict[str, list[dict]]) -> str:
    mb = 2**20

    def med(results: list[dict], pick) -> float:
        return statistics.median(pick(r) for r in results)

    def held(mode: str, key: str) -> float:
        return med(runs[mode], lambda r: max(rank["held"][key] for rank in r["ranks"])) / mb

    def rss(results: list[dict]) -> float:
        return med(results, lambda r: max(rank["rss_mb"] for rank in r["ranks"]))

    def row(name: str, values: list[float], fmt: str = "{:.0f}", bold: bool = False) -> str:
        ratios = " / ".join(f"{v / values[0]:.2f}" for v in values[1:] if v == v)  # (NaN: not run)
        cells = " | ".join(fmt.format(v) if v == v else "-" for v in values)
        return f"| {name} | {cells} | {'**' + ratios + '**' if bold else ratios} |"

    first = runs["ddp"][0]
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), Python "
        f"{platform.python_version()}, torch {__import__('torch').__version__}, gloo; {len(runs['ddp'])} "
        f"interleaved rounds; medians. Model: {first['params'] / 1e6:.1f}M parameters ({BLOCKS} residual "
        f"blocks {DIM}-{HIDDEN}-{DIM} and a head), AdamW, {first['world']} processes x 1 thread, batch {BS} "
        "per process. Bytes are what each rank holds right after an optimizer step.",
        "",
        "| per rank | DDP | sharded | sharded, `reshard_after_forward=False` | sharded / DDP (both) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, name in (("params", "parameters MB"), ("grads", "gradients MB"), ("opt", "AdamW state MB")):
        lines.append(row(name, [held(m, key) for m in MODES]))
    lines.append(
        row("**parameters + gradients + optimizer MB**", [held(m, "total") for m in MODES], bold=True)
    )
    fixed = " ".join(f"{k}={v}" for k, v in FIXED_MALLOC.items())
    lines.append(row(f"peak RSS MB, `{fixed}`", [rss(runs[m]) for m in MODES]))
    if default_malloc:
        ddp, shard, hold = (rss(default_malloc[m]) for m in ("ddp", "shard", "shard-hold"))
        nan = float("nan")
        lines.append(row("peak RSS MB, no variable set (sharded: unison sets it)", [ddp, shard, nan]))
        lines.append(row("peak RSS MB, no variable, `release_memory=False`", [ddp, hold, nan]))
    speeds = [med(runs[m], lambda r: r["samples_per_s"]) for m in MODES]
    lines.append(row(f"training samples/s, `{fixed}`", speeds, fmt="{:.1f}"))
    if default_malloc:
        ddp, shard, hold = (med(default_malloc[m], lambda r: r["samples_per_s"]) for m in default_malloc)
        lines.append(row("training samples/s, no variable set", [ddp, shard, nan], fmt="{:.1f}"))
        lines.append(
            row("training samples/s, no variable, `release_memory=False`", [ddp, hold, nan], fmt="{:.1f}")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=(*MODES, "shard-hold"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    default_malloc: dict[str, list[dict]] = {"ddp": [], "shard": [], "shard-hold": []}
    for i in range(args.repeats):
        for mode in MODES:
            runs[mode].append(launch(mode, FIXED_MALLOC))
            print(f"round {i + 1} {mode}: {json.dumps(runs[mode][-1])}", flush=True)
    for mode in default_malloc:  # one round without the variable: what a user sees
        default_malloc[mode].append(launch(mode, {}))
        print(f"default malloc {mode}: {json.dumps(default_malloc[mode][-1])}", flush=True)
    text = table(runs, default_malloc)
    print(text)
    if not args.no_write:
        results = HERE / "RESULTS.md"
        old = results.read_text() if results.exists() else ""
        section = f"{BEGIN}\n## Sharded vs DDP (`python benchmarks/sharded.py`)\n\n{text}\n{END}"
        if BEGIN in old and END in old:
            new = old[: old.index(BEGIN)] + section + old[old.index(END) + len(END) :]
        else:
            new = old.rstrip("\n") + "\n\n" + section + "\n"
        results.write_text(new)


if __name__ == "__main__":
    main()

"""Sharded training: unison's distrib_ctx(shard=True) against a hand-written FSDP2 loop, 2 CPU processes.

    python benchmarks/sharded.py               # 5 interleaved rounds; updates its section of RESULTS.md
    python benchmarks/sharded.py --repeats 1 --no-write --modes shard shard-nocheck ddp
    STEPS=10 EPOCHS=4 python benchmarks/sharded.py   # a longer timed part

Each round launches, with torchrun (2 processes x 1 thread, gloo), the hand-written loop
(torch's `fully_shard` per residual block and at the root, `DistributedSampler`, AdamW) and
then each of `--modes`: the same 50M-parameter model, data, global batch and AdamW, through
unison (`distrib_ctx(shard=True)` and variants: `release_memory=True`, `on_nonfinite=None`,
`reshard_after_forward=False`, DDP) or the hand-written loop under the malloc setting that
unison's `release_memory=True` makes (`hand-release`). Every round runs them all under each of
`--envs`: torchrun's environment, and the one `unison launch` gives its workers
(`THP_MEM_ALLOC_ENABLE=1`), the hand-written loop included, each environment its own table.
Rank 0 reports training samples/s over the epochs after the first; both ranks report their CPU
time over those epochs, the bytes of parameters, gradients and optimizer state they hold right
after their first optimizer step, and their peak RSS. Ratios are per round (each mode against
that round's hand-written run in the same environment), reported as median and min-max.
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
DIM, HIDDEN, BLOCKS, BS = 1024, 4096, 6, 16
STEPS, EPOCHS = int(os.environ.get("STEPS", "6")), int(os.environ.get("EPOCHS", "3"))


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(DIM, 10)), Block


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    n = BS * 2 * STEPS
    return torch.randn(n, DIM, generator=g), torch.randint(0, 10, (n,), generator=g)


def _held(model, opt) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards under FSDP)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    held = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "opt": sum(local_bytes(v) for v in state),
    }
    held["total"] = sum(held.values())
    return held


def _report(
    mode: str, n_params: int, times: list[float], cpu: list[float], held: dict[str, int], n: int
) -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    everyone = [None] * world
    # CPU seconds (user + system, every thread) of the timed epochs: what the step costs this rank,
    # much less moved than wall time by other jobs on a shared machine.
    dist.all_gather_object(everyone, {"held": held, "rss_mb": rss_mb, "cpu_s": sum(cpu[1:])})
    if dist.get_rank() == 0:
        steady = sum(times[1:])
        result = {
            "mode": mode,
            "params": n_params,
            "world": world,
            "samples_per_s": (len(times) - 1) * n / steady,
            "cpu_ms_per_sample": 1000 * sum(r["cpu_s"] for r in everyone) / ((len(times) - 1) * n),
            "ranks": everyone,
        }
        print("RESULT " + json.dumps(result), flush=True)


def hand_worker(mode: str = "hand") -> None:
    """The hand-written FSDP2 loop: torch's fully_shard per block and at the root, AdamW."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, block = _model()
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        if isinstance(m, block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = _data()
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
    dl = DataLoader(TensorDataset(x, y), batch_size=BS, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_func = nn.CrossEntropyLoss()
    times, cpu, held = [], [], {}
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        start, cpu_start = time.perf_counter(), time.process_time()
        for xb, yb in dl:
            loss_func(model(xb), yb).backward()
            opt.step()
            if not held:
                held = _held(model, opt)
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    _report(mode, n_params, times, cpu, held, len(x))
    dist.destroy_process_group()


def worker(mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from unison import Callback, DataLoaders, Learner, set_seed

    torch.set_num_threads(1)

    class Measure(Callback):
        def __init__(self) -> None:
            self.held: dict[str, int] = {}
            self.times: list[float] = []
            self.cpu: list[float] = []

        def before_train(self) -> None:
            self._start, self._cpu = time.perf_counter(), time.process_time()

        def after_train(self) -> None:
            self.times.append(time.perf_counter() - self._start)
            self.cpu.append(time.process_time() - self._cpu)

        def after_step(self) -> None:  # before zero_grad: weights, gradients and optimizer state all live
            if not self.held:
                self.held = _held(self.learn.model, self.learn.opt)

    set_seed(0)
    model, _ = _model()
    n_params = sum(p.numel() for p in model.parameters())
    x, y = _data()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True), None)
    measure = Measure()
    nonfinite = None if mode == "shard-nocheck" else "stop"
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-4, cbs=[measure], on_nonfinite=nonfinite)
    learn.recorder.print_table = False
    options: dict = {}
    if mode != "ddp":
        options = {"shard": True, "reshard_after_forward": mode != "shard-keep"}
        options["release_memory"] = mode == "shard-release"
    with learn.distrib_ctx(**options):
        learn.fit(EPOCHS)
        _report(mode, n_params, measure.times, measure.cpu, measure.held, len(x))
        dist.barrier()


def launch(mode: str, extra_env: dict[str, str] | None = None) -> dict:
    """One torchrun launch (2 processes x 1 thread) of a mode; rank 0's RESULT."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if mode == "hand-release":  # the hand-written loop with the malloc setting unison's default makes
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, __file__, "--worker", mode], env=env, capture_output=True, text=True, timeout=900
    )
    found = re.findall(r"RESULT (\{.*\})", proc.stdout)
    if not found:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{tail}")
    return json.loads(found[0])


def spread(values: list[float]) -> str:
    """Median, and the min-max range beside it."""
    return f"**{statistics.median(values):.3f}** ({min(values):.3f}-{max(values):.3f})"


def table(runs: dict[str, list[dict]], load: str) -> str:
    mb = 2**20

    def med(results: list[dict], pick) -> float:
        return statistics.median(pick(r) for r in results)

    def held(mode: str, key: str) -> float:
        return med(runs[mode], lambda r: max(rank["held"][key] for rank in r["ranks"])) / mb

    def rss(mode: str) -> float:
        return med(runs[mode], lambda r: max(rank["rss_mb"] for rank in r["ranks"]))

    def ratios(mode: str, key: str, base: str = "hand") -> list[float]:
        return [a[key] / b[key] for a, b in zip(runs[mode], runs[base], strict=True)]

    first = runs["hand"][0]
    rounds = len(runs["hand"])
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({load}), Python "
        f"{platform.python_version()}, torch {__import__('torch').__version__}, gloo, torchrun. Model: "
        f"{first['params'] / 1e6:.1f}M parameters ({BLOCKS} residual blocks {DIM}-{HIDDEN}-{DIM}, a head), "
        f"AdamW, {first['world']} processes x 1 thread, batch {BS} per process, {STEPS} steps an epoch, "
        f"{EPOCHS} epochs (the first not timed). {rounds} interleaved rounds: medians, and the min-max of "
        "the per-round ratios. CPU ms per sample: user + system time of both ranks (all threads) over the "
        "timed epochs. Bytes are what each rank holds right after its first optimizer step.",
        "",
        "| per rank | samples/s | speed / hand-written (min-max) | CPU ms per sample "
        "| CPU / hand-written (min-max) | params+grads+AdamW MB | peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in runs:
        speed = med(runs[mode], lambda r: r["samples_per_s"])
        cpu = med(runs[mode], lambda r: r["cpu_ms_per_sample"])
        vs_speed = "1" if mode == "hand" else spread(ratios(mode, "samples_per_s"))
        vs_cpu = "1" if mode == "hand" else spread(ratios(mode, "cpu_ms_per_sample"))
        lines.append(
            f"| {LABELS[mode]} | {speed:.1f} | {vs_speed} | {cpu:.0f} | {vs_cpu} | {held(mode, 'total'):.0f} "
            f"| {rss(mode):.0f} |"
        )
    return "\n".join(lines)


LABELS = {
    "hand": "hand-written FSDP2 loop (`fully_shard` per block and root)",
    "hand-release": "hand-written, `MALLOC_MMAP_THRESHOLD_=65536` (what `release_memory=True` sets)",
    "shard": "unison `distrib_ctx(shard=True)` (defaults)",
    "shard-release": "unison, `release_memory=True`",
    "shard-nocheck": "unison, `on_nonfinite=None`",
    "shard-keep": "unison, `reshard_after_forward=False`",
    "ddp": "unison `distrib_ctx()` (DDP, unsharded)",
}


#: Each environment runs every mode (hand-written loop included) and gets its own table.
ENVS: dict[str, tuple[str, dict[str, str]]] = {
    "torchrun": ("As torchrun starts them (glibc and torch defaults)", {"THP_MEM_ALLOC_ENABLE": "0"}),
    "thp": (
        "As `unison launch` starts them (`THP_MEM_ALLOC_ENABLE=1`: torch backs CPU buffers of 2 MB and "
        "more with transparent huge pages), the hand-written loop too",
        {"THP_MEM_ALLOC_ENABLE": "1"},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=tuple(LABELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["shard", "shard-release"], choices=tuple(LABELS))
    parser.add_argument(
        "--envs",
        nargs="+",
        default=list(ENVS),
        choices=tuple(ENVS),
        help="malloc environments, each a table (default: torchrun's and the one `unison launch` sets)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.worker in ("hand", "hand-release"):
        hand_worker(args.worker)
        return
    if args.worker:
        worker(args.worker)
        return
    modes = ["hand", *[m for m in args.modes if m != "hand"]]
    runs: dict[str, dict[str, list[dict]]] = {e: {m: [] for m in modes} for e in args.envs}
    for i in range(args.repeats):
        for env in args.envs:  # interleaved: every environment and mode once a round
            for mode in modes:
                runs[env][mode].append(launch(mode, ENVS[env][1]))
                r = runs[env][mode][-1]
                print(
                    f"round {i + 1} {env} {mode}: {r['samples_per_s']:.2f} samples/s, "
                    f"{r['cpu_ms_per_sample']:.0f} CPU ms/sample",
                    flush=True,
                )
    load = "load average " + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + " at the end"
    text = "\n\n".join(f"{ENVS[env][0]}:\n\n{table(runs[env], load)}" for env in args.envs)
    print(text)
    if not args.no_write:
        results = HERE / "RESULTS.md"
        old = results.read_text() if results.exists() else ""
        section = (
            f"{BEGIN}\n## Sharded: unison vs a hand-written FSDP2 loop (`python benchmarks/sharded.py`)"
            f"\n\n{text}\n{END}"
        )
        if BEGIN in old and END in old:
            new = old[: old.index(BEGIN)] + section + old[old.index(END) + len(END) :]
        else:
            new = old.rstrip("\n") + "\n\n" + section + "\n"
        results.write_text(new)


if __name__ == "__main__":
    main()

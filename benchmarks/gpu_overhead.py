"""What unison costs per step on a GPU: a hand-written DDP loop against the same training on a
unison `Learner` and on `unison.Run`, interleaved rounds.

A GPU step of a small model takes milliseconds, so a framework's Python work per step (callbacks,
events, the exact loss's count, the progress bar) shows here where a CPU step would hide it. All
three train nanoGPT's model (examples/nanogpt/model.py; 6 layers, 384 wide, 256 tokens, batch 32 by
default) on the same random token windows with AdamW, bf16 autocast and gradient clipping at 1.0,
under DDP on NCCL (one process per GPU):

- hand-written: nanoGPT's loop (`torchrun`, `DDP(model)`, `model(x, y)`'s mean loss, `.to(device)`);
- Learner: `Learner(..., cbs=[MixedPrecision("bf16"), GradientClip(1.0)])`, `distrib_ctx`, `fit(1)`,
  its progress bar on (`unison launch` relays it);
- Run: the same loop as the hand-written one on `unison.Run` (`run.loss(sum, count)`, `run.backward`).

Each run times the steps after the first `--skip` (CUDA synchronised at both ends) and reports ms
per step and rank 0's CPU ms per step; the report gives each peer's median over rounds and the
median of the rounds' ratios (hand-written ms / peer ms: 1.0 = as fast).

    python benchmarks/gpu_overhead.py                    # 3 rounds of 300 steps on 1 GPU
    python benchmarks/gpu_overhead.py --rounds 5 --nproc 2
    python benchmarks/gpu_overhead.py --tiny --rounds 1  # a CPU dry run (gloo) of the three scripts
    python benchmarks/gpu_overhead.py --trace-ops        # + each thread's CPU, one step's CPU ops

`--trace-ops` is how unison's extra CPU time on a GPU was found (docs/gpus.md): a thread named
like the main one is OpenMP's, and an op on a CPU tensor that the hand-written loop lacks is the
suspect.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "nanogpt"))


def _config(tiny: bool) -> dict[str, int]:
    if tiny:
        return {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "batch": 4, "vocab": 65}
    return {"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 256, "batch": 32, "vocab": 65}


def _setup(tiny: bool, steps: int):
    import torch
    from model import GPT, GPTConfig
    from torch.utils.data import TensorDataset

    c = _config(tiny)
    torch.manual_seed(0)
    model = GPT(GPTConfig(c["vocab"], c["block_size"], c["n_layer"], c["n_head"], c["n_embd"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(c["vocab"], (steps * c["batch"] * world, c["block_size"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt, data, c["batch"]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, summed by thread name (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return found


class _CpuOps:
    """Counts the aten ops of one step that touch a CPU tensor of more than one element: what a
    framework adds on the CPU to a GPU step (a dispatch mode; backward's ops included)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                from torch.utils._pytree import tree_leaves

                for leaf in tree_leaves((args, kwargs or {})):
                    if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.numel() > 1:
                        key = f"{func} {tuple(leaf.shape)} {leaf.dtype}"
                        counts[key] = counts.get(key, 0) + 1
                        break
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Mode()


class _Clock:
    """ms and CPU ms per step over the steps after `skip`, CUDA synchronised at both ends; with
    `--trace-ops`, also the CPU-tensor ops of the step after `skip`."""

    def __init__(self, skip: int, trace_ops: bool = False):
        self.skip, self.step, self.start = skip, 0, None
        self.ops = _CpuOps() if trace_ops else None

    def tick(self) -> None:
        import torch

        self.step += 1
        if self.ops is not None and self.step == self.skip + 1:
            self.ops.mode.__enter__()
        if self.ops is not None and self.step == self.skip + 2:
            self.ops.mode.__exit__(None, None, None)
        if self.step == self.skip:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = (time.perf_counter(), time.process_time())
            self.threads = _thread_cpu()

    def report(self, peer: str, loss: float) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - self.start[0], time.process_time() - self.start[1]
        n = self.step - self.skip
        if int(os.environ.get("RANK", "0")) == 0:
            row = {"peer": peer, "ms": 1000 * wall / n, "cpu_ms": 1000 * cpu / n, "steps": n, "loss": loss}
            row["threads"] = torch.get_num_threads()
            print("RESULT " + json.dumps(row), flush=True)
            now = _thread_cpu()
            spent = {name: 1000 * (now[name] - self.threads.get(name, 0.0)) / n for name in now}
            top = sorted(spent.items(), key=lambda kv: -kv[1])[:6]
            print(f"THREADS {peer}: " + ", ".join(f"{name} {ms:.1f}" for name, ms in top) + " (CPU ms/step)")
            if self.ops is not None:
                for key, count in sorted(self.ops.counts.items(), key=lambda kv: -kv[1])[:40]:
                    print(f"CPUOP {peer}: {count} x {key}")


def peer_plain(args) -> None:
    """nanoGPT's DDP loop, as written by hand."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.nn.utils import clip_grad_norm_
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, opt, data, batch = _setup(args.tiny, args.steps)
    model = DDP(model.to(device), device_ids=[local] if cuda else None)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
    clock = _Clock(args.skip, args.trace_ops)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.tick()
    clock.report("hand-written", float(loss))
    dist.destroy_process_group()


def peer_run(args) -> None:
    """The same loop on `unison.Run`."""
    import torch
    from torch.utils.data import DataLoader

    import unison

    model, opt, data, batch = _setup(args.tiny, args.steps)
    with unison.Run() as run:
        model, opt = run.setup(model, opt)
        run.add_cb(unison.GradientClip(1.0))
        loader = run.loader(DataLoader(data, batch_size=batch))
        clock = _Clock(args.skip, args.trace_ops)
        for _ in run.epochs(1):
            for x, y in loader:
                with torch.autocast(run.device.type, dtype=torch.bfloat16):
                    _, loss = model(x, y, reduction="sum")
                run.backward(run.loss(loss, count=y.numel()))
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock.tick()
        clock.report("unison Run", float(loss) / y.numel())


def peer_learner(args) -> None:
    """The same training on a unison `Learner`."""
    from torch import nn
    from torch.utils.data import DataLoader

    from unison import Callback, DataLoaders, GradientClip, Learner, MixedPrecision, ProgressCallback
    from unison.losses import TokenCrossEntropy

    gpt, opt, data, batch = _setup(args.tiny, args.steps)

    class Logits(nn.Module):
        def __init__(self, gpt: nn.Module):
            super().__init__()
            self.gpt = gpt

        def forward(self, x):
            return self.gpt(x)[0]

    clock = _Clock(args.skip, args.trace_ops)

    class Tick(Callback):
        order = 99

        def after_step(self):
            clock.tick()

    learn = Learner(
        DataLoaders(DataLoader(data, batch_size=batch)),
        Logits(gpt),
        TokenCrossEntropy(),
        opt_func=lambda params, lr: type(opt)(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
        lr=3e-4,
        cbs=[MixedPrecision("bf16"), GradientClip(1.0), Tick()],
    )
    learn.get_cb(ProgressCallback).show = True  # the default bar, as a user sees it
    learn.recorder.print_table = False
    with learn.distrib_ctx():
        learn.fit(1)
    clock.report("unison Learner", float(learn.recorder.losses[-1]))


PEERS = {"hand-written": peer_plain, "unison Learner": peer_learner, "unison Run": peer_run}


def _command(peer: str, args) -> list[str]:
    script = [
        str(Path(__file__).resolve()),
        "--peer",
        peer,
        "--steps",
        str(args.steps),
        "--skip",
        str(args.skip),
    ]
    script += ["--tiny"] if args.tiny else []
    script += ["--trace-ops"] if args.trace_ops else []
    if peer == "hand-written":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            *script,
        ]
    import torch

    where = (
        ["--gpus", ",".join(map(str, range(args.nproc)))]
        if torch.cuda.is_available()
        else ["--nproc", str(args.nproc)]
    )
    return [sys.executable, "-m", "unison.launch", *where, *script]


def driver(args) -> None:
    import torch

    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
    }
    results: dict[str, list[dict]] = {peer: [] for peer in PEERS}
    for r in range(args.rounds):
        for peer in PEERS:
            start = time.perf_counter()
            proc = subprocess.run(_command(peer, args), capture_output=True, text=True, env=env, timeout=600)
            found = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
            if proc.returncode != 0 or not found:
                raise RuntimeError(
                    f"{peer} failed (exit {proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
                )
            row = {**found[0], "launch_s": time.perf_counter() - start}
            results[peer].append(row)
            print(
                f"round {r + 1}/{args.rounds} {peer}: {row['ms']:.2f} ms/step, "
                f"{row['cpu_ms']:.2f} CPU ms/step ({row['threads']} threads), "
                f"loss {row['loss']:.4f}, launch {row['launch_s']:.1f} s",
                flush=True,
            )
            for line in proc.stdout.splitlines():
                if "THREADS " in line or "CPUOP " in line:
                    print("   ", line.strip(), flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    c = _config(args.tiny)
    print(
        f"\n{args.nproc} x {device}, torch {torch.__version__}; GPT {c['n_layer']} layers x {c['n_embd']}, "
        f"{c['block_size']} tokens, batch {c['batch']} per process, bf16 autocast, AdamW, clip 1.0; "
        f"{args.rounds} interleaved rounds of {args.steps} steps, the first {args.skip} left out\n"
    )
    print(
        "| peer | ms/step, median (min-max) | CPU ms/step (rank 0) | hand-written ms / peer ms | launch s |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    base = results["hand-written"]
    for peer, rows in results.items():
        ms = [row["ms"] for row in rows]
        ratio = statistics.median(b["ms"] / row["ms"] for b, row in zip(base, rows, strict=True))
        print(
            f"| {peer} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | "
            f"{statistics.median(row['cpu_ms'] for row in rows):.2f} | {ratio:.3f} | "
            f"{statistics.median(row['launch_s'] for row in rows):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", choices=sorted(PEERS), help="(internal) run one peer in a launched worker")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=50, help="first steps left out of the timing")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (one process each)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a CPU dry run)")
    parser.add_argument(
        "--trace-ops", action="store_true", help="also list one step's CPU-tensor ops and each thread's CPU"
    )
    args = parser.parse_args()
    if args.peer:
        PEERS[args.peer](args)
    else:
        driver(args)


if __name__ == "__main__":
    main()

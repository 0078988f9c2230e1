"""What the exact loss's count all-reduce costs a step, blocking or overlapped with the backward pass.

A loss counted by the loop (`run.loss(sum, count=tokens)`) needs the step's count summed over the
ranks. unison used to sum it with a blocking all-reduce after the backward pass; it now starts an
asynchronous one before it (`Collective.start_sum`) and reads it after. This measures the three
ways inside the same 2 processes, nanoGPT's model and step (DDP, AdamW, 2 micro-batches of 8x64
tokens), alternating blocks of steps (none, blocking, overlapped, none, ...) so that the machine's
load hits each alike; it reports the median ms per step of each and the difference to none.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/step_count_overlap.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402

BLOCKS, STEPS_PER_BLOCK, MICRO = 30, 10, 2


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(vocab_size=80)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 80, (8, 64), generator=g)

    def step(mode: str) -> None:
        pending = None
        for micro in range(MICRO):
            last = micro == MICRO - 1
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                _, loss = model(x, x, reduction="sum")
                count = torch.tensor([float(x.numel())], dtype=torch.float64)
                if last and mode == "overlapped":
                    pending = dist.all_reduce(count, async_op=True)
                (loss / 8).backward()
        if mode == "blocking":
            dist.all_reduce(count)
        elif pending is not None:
            pending.wait()
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {"none": [], "blocking": [], "overlapped": []}
    for mode in times:  # warm-up
        for _ in range(5):
            step(mode)
    for _ in range(BLOCKS):
        for mode, out in times.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS_PER_BLOCK):
                step(mode)
            out.append((time.perf_counter() - start) / STEPS_PER_BLOCK * 1000)
    if rank == 0:
        base = statistics.median(times["none"])
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"{BLOCKS} interleaved blocks of {STEPS_PER_BLOCK} steps, 2 processes x 1 thread; load {load}")
        for mode, out in times.items():
            med = statistics.median(out)
            print(f"{mode:>10}: {med:.2f} ms/step (median of blocks), {med - base:+.2f} ms against none")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

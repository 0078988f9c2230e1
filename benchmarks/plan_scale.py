"""Time to the first batch and peak memory of one rank's epoch, 10^6 to 10^10 items, shuffled and
unshuffled: torch's `DistributedSampler`, unison's tensor plan (order="torch") and its
constant-memory orders (order="scalable"; an unshuffled loader's identity order), each run in a
fresh process (peak RSS above the process after its imports).

"First batch" is what a training loop waits for at an epoch's start: torch,
`next(iter(BatchSampler(DistributedSampler(ds, shuffle=...), bs)))` (the sampler lists the whole
order first); unison, `next(iter(DistributedDL(DataLoader(ds, batch_size=bs, shuffle=...))))`
over a dataset whose item is its index (so the batch is fetched and collated too). The
constant-memory orders are also timed resuming at the middle of the epoch, and over the next
`--walk` batches (their steady cost per batch). Sizes a planner would need more than `--max-gb`
for are skipped and printed as such (estimated from the bytes per item measured at 10^7).

    python benchmarks/plan_scale.py                      # 10^6 .. 10^10, W=2, bs=256; Markdown tables
    python benchmarks/plan_scale.py --sizes 1e6 1e10 --repeats 1 --kinds unison-seq
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from plan_epoch import Indices, _rss_mb  # the same free dataset and RSS reading (benchmarks/ is on the path)

# Bytes per item measured at 10^7 items, W=2 (rank 0): what decides which sizes fit.
BYTES_PER_ITEM = {"torch": 48.0, "unison": 17.0, "scalable": 0.0, "torch-seq": 44.0, "unison-seq": 0.0}
LABELS = {
    "torch": "torch DistributedSampler + BatchSampler, shuffled",
    "unison": 'unison DistributedDL, shuffled, order="torch" (tensor plan)',
    "scalable": 'unison DistributedDL, shuffled, order="scalable"',
    "torch-seq": "torch DistributedSampler(shuffle=False) + BatchSampler",
    "unison-seq": "unison DistributedDL, unshuffled (identity order)",
}
PER_POSITION = ("scalable", "unison-seq")  # the orders evaluated per position: resume and walk timed


def _child(kind: str, items: int, world: int, bs: int, walk: int) -> dict[str, float]:
    from torch.utils.data import BatchSampler, DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from unison.data import DistributedDL

    ds = Indices(items)
    shuffle = not kind.endswith("-seq")
    before = _rss_mb()
    start = time.perf_counter()
    out: dict[str, float] = {}
    if kind.startswith("torch"):
        sampler = DistributedSampler(ds, num_replicas=world, rank=0, shuffle=shuffle, seed=0)
        sampler.set_epoch(0)
        next(iter(BatchSampler(sampler, bs, drop_last=False)))
        out["first_s"] = time.perf_counter() - start
    else:
        order = "scalable" if kind == "scalable" else "torch"  # unshuffled: the identity either way
        dl = DataLoader(ds, batch_size=bs, shuffle=shuffle)
        ddl = DistributedDL(dl, 0, world, seed=0, pad=False, order=order)
        batches = iter(ddl)
        next(batches)
        out["first_s"] = time.perf_counter() - start
        if kind in PER_POSITION:
            start = time.perf_counter()
            for _ in range(walk):
                next(batches)
            out["per_batch_ms"] = (time.perf_counter() - start) / max(walk, 1) * 1e3
            start = time.perf_counter()
            ddl.set_start(len(ddl) // 2)
            next(iter(ddl))
            out["resume_s"] = time.perf_counter() - start
    out["peak_mb"] = _rss_mb() - before
    return out


def _fmt(values: list[float], spec: str) -> str:
    return format(statistics.median(values), spec) if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e9, 1e10])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--walk", type=int, default=1000, help="batches walked after the first (scalable)")
    parser.add_argument(
        "--max-gb", type=float, default=6.0, help="skip a planner needing more (shared machine)"
    )
    parser.add_argument("--kinds", nargs="+", choices=list(LABELS), default=list(LABELS))
    parser.add_argument("--child", choices=list(LABELS))
    parser.add_argument("--items", type=int)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.items, args.world, args.bs, args.walk)))
        return
    sizes = [int(s) for s in args.sizes]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    skipped: dict[tuple[str, int], float] = {}
    for kind in args.kinds:
        for n in sizes:
            need = BYTES_PER_ITEM[kind] * n / 2**30
            if need > args.max_gb:
                skipped[kind, n] = need
            else:
                runs[kind, n] = []
    load_start = os.getloadavg()
    for _ in range(args.repeats):  # interleaved rounds: a loaded machine slows every planner alike
        for kind, n in runs:
            cmd = [sys.executable, __file__, "--child", kind, "--items", str(n), "--world", str(args.world)]
            cmd += ["--bs", str(args.bs), "--walk", str(args.walk)]
            runs[kind, n].append(json.loads(subprocess.check_output(cmd, text=True)))
    load = os.getloadavg()
    print(
        f"W={args.world}, rank 0, bs={args.bs}, {args.repeats} interleaved rounds, medians; "
        f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at the start, "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end, on {os.cpu_count()} cores"
    )
    print("| planner | items | first batch s | peak RSS above the interpreter MB |")
    print("| --- | ---: | ---: | ---: |")
    for kind in args.kinds:
        label = LABELS[kind]
        for n in sizes:
            if (kind, n) in skipped:
                print(f"| {label} | 10^{len(str(n)) - 1} | skipped: needs ~{skipped[kind, n]:.0f} GB | - |")
                continue
            r = runs[kind, n]
            first = _fmt([x["first_s"] for x in r], ".3f")
            peak = _fmt([x["peak_mb"] for x in r], ".0f")
            print(f"| {label} | 10^{len(str(n)) - 1} | {first} | {peak} |")
    per_position = [
        (k, n, runs[k, n]) for k in args.kinds if k in PER_POSITION for n in sizes if (k, n) in runs
    ]
    if per_position:
        print()
        print("Orders evaluated per position: resuming at the middle step, and each of the next batches")
        print("| planner | items | first batch at the middle step s | ms per batch after the first |")
        print("| --- | ---: | ---: | ---: |")
        for kind, n, r in per_position:
            resume = _fmt([x["resume_s"] for x in r], ".3f")
            per = _fmt([x["per_batch_ms"] for x in r], ".2f")
            print(f"| {LABELS[kind]} | 10^{len(str(n)) - 1} | {resume} | {per} |")


if __name__ == "__main__":
    main()

"""Time and memory to plan one epoch of a shuffled map-style dataset on one rank of W, against torch's
`DistributedSampler` (each in a fresh process: peak RSS over the process's size before planning).

"Plan" is drawing the epoch's order and walking every index batch of this rank, as a DataLoader's
batch sampler does (no data is fetched): torch, `BatchSampler(DistributedSampler(ds), bs)`; unison,
`DistributedDL(DataLoader(ds, batch_size=bs, shuffle=True))`'s plan (an int64 tensor, 1/W kept).

    python benchmarks/plan_epoch.py                  # 20M items, W=2, bs=256; prints a Markdown table
    python benchmarks/plan_epoch.py --items 1000000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


class Indices:
    """A map-style dataset of `n` items that costs nothing to hold."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one(kind: str, items: int, world: int, bs: int) -> dict[str, float]:
    from torch.utils.data import BatchSampler, DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from unison.data import DistributedDL

    ds = Indices(items)
    before = _rss_mb()
    start = time.perf_counter()
    batches = 0
    if kind == "torch":
        sampler = DistributedSampler(ds, num_replicas=world, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(0)
        for _ in BatchSampler(sampler, bs, drop_last=False):
            batches += 1
    else:
        ddl = DistributedDL(DataLoader(ds, batch_size=bs, shuffle=True), 0, world, seed=0, pad=False)
        plan = ddl._plan(0)  # what iter(ddl) does before its loader asks for batches
        first = time.perf_counter() - start
        for _ in plan.batches():
            batches += 1
    seconds = time.perf_counter() - start
    out = {"s": seconds, "peak_mb": _rss_mb() - before, "batches": batches}
    if kind == "unison":
        out["plan_s"] = first
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=20_000_000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["torch", "unison"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.items, args.world, args.bs)))
        return
    runs: dict[str, list[dict[str, float]]] = {"torch": [], "unison": []}
    for _ in range(args.repeats):  # interleaved: a loaded machine slows both alike
        for kind in runs:
            cmd = [sys.executable, __file__, "--child", kind, "--items", str(args.items)]
            cmd += ["--world", str(args.world), "--bs", str(args.bs)]
            runs[kind].append(json.loads(subprocess.check_output(cmd, text=True)))
    print(f"{args.items:,} items, W={args.world}, bs={args.bs}, rank 0, {args.repeats} rounds, medians")
    print("| planner | time s | peak extra RSS MB | batches |")
    print("| --- | ---: | ---: | ---: |")
    labels = {"torch": "torch DistributedSampler + BatchSampler", "unison": "unison DistributedDL"}
    for kind, label in labels.items():
        r = runs[kind]
        s = statistics.median(x["s"] for x in r)
        mb = statistics.median(x["peak_mb"] for x in r)
        print(f"| {label} | {s:.2f} | {mb:.0f} | {r[0]['batches']} |")
    plan_s = statistics.median(x["plan_s"] for x in runs["unison"])
    print(f"unison: order drawn and this rank's plan made in {plan_s:.2f} s (the rest walks its batches)")


if __name__ == "__main__":
    main()

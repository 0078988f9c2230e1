"""Side-by-side benchmark: unison's Learner vs a hand-written DDP loop, interleaved.

Both peers train the same model on the same data with the same global batch and
optimizer (benchmarks/workload.py), launched the same way (torchrun, gloo, 2
processes x 1 thread unless told otherwise), alternating a b a b ... so that drift
in the machine's load hits both alike. Only medians of interleaved runs are reported.

    python benchmarks/run.py                # the full table (also written to benchmarks/RESULTS.md)
    python benchmarks/run.py --repeats 3 --workloads mlp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable


def run_peer(
    script: str,
    workload: str,
    nproc: int,
    precision: str = "fp32",
    epochs: int = 6,
    ddp_kwargs: dict | None = None,
    comm_probe: bool = False,
) -> dict:
    """One launch of a peer; the merged RESULT lines of its ranks."""
    env = {
        **os.environ,
        "WL": workload,
        "EPOCHS": str(epochs),
        "THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PRECISION": precision,
        "DDP_KWARGS": json.dumps(ddp_kwargs or {}),
        "PYTHONUNBUFFERED": "1",
        "COMM_PROBE": "1" if comm_probe else "0",
    }
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(HERE / script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # Ranks write concurrently: two RESULT records can share a line.
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    if len(results) != nproc:
        raise RuntimeError(
            f"{script} {workload} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    if proc.returncode != 0:  # every rank reported, then one died at exit (seen: gloo teardown SIGABRT)
        print(f"  note: {script} exited {proc.returncode} after all ranks reported", flush=True)
    rank0 = next(r for r in results if r["rank"] == 0)
    return {
        "samples_per_s": rank0["samples_per_s"],
        "valid_acc": rank0["valid_acc"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "first_step_s": max(r["first_step_s"] for r in results),
        "comm_frac": rank0.get("comm_frac"),
    }


def interleaved(pairs: list[tuple[str, dict]], repeats: int) -> dict[str, list[dict]]:
    """Run every (label, peer kwargs) in turn, `repeats` rounds: a b a b ..."""
    out: dict[str, list[dict]] = {label: [] for label, _ in pairs}
    for i in range(repeats):
        for label, kwargs in pairs:
            out[label].append(run_peer(**kwargs))
            print(
                f"  round {i + 1}/{repeats} {label}: {out[label][-1]['samples_per_s']} samples/s", flush=True
            )
    return out


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def per_round(a: list[dict], b: list[dict]) -> list[float]:
    """Per-round ratios a/b of samples/s (each round's pair ran back to back)."""
    return [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(a, b, strict=True)]


def ratios(a: list[dict], b: list[dict]) -> float:
    """Median of per-round ratios a/b."""
    return statistics.median(per_round(a, b))


def spread(a: list[dict], b: list[dict], bold: bool = True) -> str:
    """The median per-round ratio a/b, and the min-max of those ratios beside it."""
    r = per_round(a, b)
    med = f"**{statistics.median(r):.3f}**" if bold else f"{statistics.median(r):.3f}"
    return f"{med} ({min(r):.3f}-{max(r):.3f})"


def import_times(repeats: int) -> tuple[float, float]:
    """Median wall time of `import torch` and of `from unison import Learner` (its public names load
    on first use; the Learner brings torch), interleaved."""

    def once(statement: str) -> float:
        start = time.perf_counter()
        subprocess.run([PY, "-c", statement], check=True)
        return time.perf_counter() - start

    torch_t, unison_t = [], []
    for _ in range(repeats):
        torch_t.append(once("import torch"))
        unison_t.append(once("from unison import Learner"))
    return statistics.median(torch_t), statistics.median(unison_t)


KNOBS = {
    "torch defaults": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "bucket_cap_mb=100": {"bucket_cap_mb": 100},
}


def compare_knobs(args: argparse.Namespace) -> None:
    """Interleaved unison runs with each DDP setting: how the defaults were chosen."""
    lines = ["| workload | " + " | ".join(KNOBS) + " |", "| --- |" + " ---: |" * len(KNOBS)]
    for wl in args.workloads:
        print(f"{wl}: DDP settings, interleaved x{args.repeats}", flush=True)
        pairs = [
            (name, dict(script="unison_ddp.py", workload=wl, nproc=2, ddp_kwargs=kw))
            for name, kw in KNOBS.items()
        ]
        res = interleaved(pairs, args.repeats)
        base = res["torch defaults"]
        cells = [f"{median(base, 'samples_per_s'):.0f} samples/s"]
        cells += [spread(res[name], base, bold=False) for name in list(KNOBS)[1:]]
        lines.append(f"| {wl} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines))


SCALING = (1, 2, 4)


def scaling(repeats: int) -> list[str]:
    """The CNN on 1, 2 and 4 processes (1 thread each), hand-written (per-rank BatchNorm) and unison
    (exact BatchNorm, the default), interleaved; efficiency = samples/s / (W x 1-process samples/s)."""
    print(f"conv scaling: {SCALING} processes, interleaved x{repeats}", flush=True)
    pairs = []
    for w in SCALING:
        pairs.append((f"raw{w}", dict(script="raw_ddp.py", workload="conv", nproc=w, comm_probe=w > 1)))
        pairs.append((f"uni{w}", dict(script="unison_ddp.py", workload="conv", nproc=w)))
    res = interleaved(pairs, repeats)
    lines = [
        "",
        f"| conv, {os.cpu_count()} cores | processes x 1 thread | samples/s | scaling efficiency (min-max) "
        "| communication share of forward+backward | unison / hand-written (min-max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, key in (("hand-written DDP (per-rank BN)", "raw"), ("unison (exact BN)", "uni")):
        one = res[f"{key}1"]
        for w in SCALING:
            runs = res[f"{key}{w}"]
            eff = [x["samples_per_s"] / (w * y["samples_per_s"]) for x, y in zip(runs, one, strict=True)]
            fracs = [r["comm_frac"] for r in runs if r.get("comm_frac") is not None]
            comm = f"{statistics.median(fracs):.0%} ({min(fracs):.0%}-{max(fracs):.0%})" if fracs else "-"
            vs = spread(runs, res[f"raw{w}"], bold=False) if key == "uni" else "1"
            lines.append(
                f"| {name} | {w} | {median(runs, 'samples_per_s'):.0f} | {statistics.median(eff):.2f} "
                f"({min(eff):.2f}-{max(eff):.2f}) | {comm} | {vs} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "conv"])
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--knobs", action="store_true", help="compare DDP settings instead (unison only)")
    args = parser.parse_args()
    if args.knobs:
        compare_knobs(args)
        return

    rows = []
    for wl in args.workloads:
        print(f"{wl}: 2 processes x 1 thread, interleaved x{args.repeats}", flush=True)
        # The hand-written loop keeps per-rank BatchNorm: unison's head-to-head run does the same
        # math (sync_bn=False); its default, exact cross-rank BatchNorm, is reported on its own row.
        same_math = {"sync_bn": False} if wl == "conv" else {}
        pairs = [
            ("raw", dict(script="raw_ddp.py", workload=wl, nproc=2)),
            ("unison", dict(script="unison_ddp.py", workload=wl, nproc=2, ddp_kwargs=same_math)),
        ]
        if wl == "conv":
            pairs.append(("unison_sync_bn", dict(script="unison_ddp.py", workload=wl, nproc=2)))
        res = interleaved(pairs, args.repeats)
        rows.append(
            (f"{wl} (sync_bn=False, as hand-written)" if wl == "conv" else wl, res["raw"], res["unison"])
        )
        if wl == "conv":
            rows.append(("conv, exact BatchNorm (default sync_bn=True)", res["raw"], res["unison_sync_bn"]))

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {__import__('torch').__version__}, gloo; {args.repeats} interleaved rounds; medians, "
        f"ratios with the min-max of the rounds'. Load average (1, 5, 15 min) at the end: "
        + ", ".join(f"{v:.1f}" for v in os.getloadavg())
        + f" on {os.cpu_count()} cores.",
        "",
    ]
    lines += [
        "| workload | hand-written DDP samples/s | unison samples/s | unison / hand-written (min-max) | "
        "peak RSS per worker (raw / unison) | first step s (raw / unison) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for wl, raw, uni in rows:
        rss_raw, rss_uni = median(raw, "peak_rss_mb"), median(uni, "peak_rss_mb")
        lines.append(
            f"| {wl} | {median(raw, 'samples_per_s'):.0f} | {median(uni, 'samples_per_s'):.0f} | "
            f"{spread(uni, raw)} | {rss_raw:.0f} / {rss_uni:.0f} MB ({rss_uni / rss_raw:.3f}x)"
            f" | {median(raw, 'first_step_s'):.2f} / {median(uni, 'first_step_s'):.2f} |"
        )

    if not args.no_scaling:
        lines += scaling(args.repeats)

    if not args.no_bf16:
        print("conv bf16 autocast on CPU vs fp32 (unison, 2 processes)", flush=True)
        pairs = [
            ("fp32", dict(script="unison_ddp.py", workload="conv", nproc=2)),
            ("bf16", dict(script="unison_ddp.py", workload="conv", nproc=2, precision="bf16")),
        ]
        res = interleaved(pairs, args.repeats)
        lines += [
            "",
            "| conv, unison, CPU | fp32 samples/s | bf16 autocast samples/s | bf16 / fp32 (min-max) "
            "| valid acc fp32 / bf16 |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| 2 processes x 1 thread | {median(res['fp32'], 'samples_per_s'):.0f} | "
            f"{median(res['bf16'], 'samples_per_s'):.0f} | {spread(res['bf16'], res['fp32'], bold=False)} | "
            f"{median(res['fp32'], 'valid_acc'):.3f} / {median(res['bf16'], 'valid_acc'):.3f} |",
        ]

    torch_s, unison_s = import_times(max(5, args.repeats))
    lines += [
        "",
        f"`import torch`: {torch_s:.2f} s; `from unison import Learner` (torch included): {unison_s:.2f} s; "
        f"unison adds **{unison_s - torch_s:+.2f} s**.",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    # This table heads the file; the other benchmarks' sections (the first `### ` or `<!--` line on)
    # are kept as they are.
    kept = out.read_text() if out.exists() else ""
    starts = [i for i in (kept.find("\n### "), kept.find("\n<!--")) if i >= 0]
    out.write_text(table + "\n" + (kept[min(starts) :] if starts else ""))


if __name__ == "__main__":
    main()

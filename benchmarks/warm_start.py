"""Warm start vs cold start of `unison launch` workers, interleaved (cold, warm, cold, warm, ...).

Each round launches a short script (a linear model, 3 AdamW steps: every worker imports torch
and, through the optimizer, torch._dynamo) with `UNISON_WARM_START=0` and then with the warm
start, and measures the CPU time of the whole launch (launcher, zygote and workers: the
children's rusage), its wall time and, in a launch whose rank 1 fails once under
`--max-restarts 1`, the gap between the failure and the restarted worker's first line of Python.

    python benchmarks/warm_start.py                # 7 rounds, the table as markdown
    python benchmarks/warm_start.py --rounds 3 --nproc 2 4
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import os, sys, time
start = time.time()
import torch
model = torch.nn.Linear(16, 1)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(32, 16)).sum().backward()
    opt.step()
out, attempt = sys.argv[1], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
with open(os.path.join(out, f"rank{os.environ['RANK']}.{attempt}"), "w") as fh:
    fh.write(f"{start} {time.time()}")
if sys.argv[2] == "fail" and os.environ["RANK"] == "1" and attempt == "0":
    raise SystemExit(1)
"""


def one_launch(script: Path, nproc: int, warm: bool, mode: str) -> tuple[float, float, float | None]:
    """CPU-s and wall s of one launch; with mode 'fail', the failure-to-restart gap in s."""
    out = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    env = {**os.environ, "UNISON_WARM_START": "1" if warm else "0"}
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", str(nproc), "--max-restarts", "1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([*cmd, str(script), str(out), mode], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    gap = None
    if mode == "fail":
        failed_at = float((out / "rank1.0").read_text().split()[1])
        gap = float((out / "rank1.1").read_text().split()[0]) - failed_at
    return cpu, wall, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp(prefix="warm-bench-")) / "short.py"
    script.write_text(SCRIPT)
    rows = []
    cases = [(n, "ok") for n in args.nproc] + [(args.nproc[0], "fail")]
    for nproc, mode in cases:
        got: dict[bool, list[tuple[float, float, float | None]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for warm in (False, True):
                got[warm].append(one_launch(script, nproc, warm, mode))

        def med(warm: bool, i: int, got: dict = got) -> float:
            return statistics.median(r[i] for r in got[warm])  # type: ignore[misc]

        what = f"{nproc} processes" + (", rank 1 fails once (--max-restarts 1)" if mode == "fail" else "")
        ratio = statistics.median(w[0] / c[0] for c, w in zip(got[False], got[True], strict=True))
        gap = f"{med(False, 2):.2f} / {med(True, 2):.2f}" if mode == "fail" else "-"
        rows.append(
            f"| {what} | {med(False, 0):.2f} / {med(True, 0):.2f} | **{ratio:.2f}** | "
            f"{med(False, 1):.2f} / {med(True, 1):.2f} | {gap} |"
        )
    print(f"{args.rounds} interleaved rounds, medians; cold = UNISON_WARM_START=0, warm = the default on CPU")
    print()
    print("| launch of a 3-step AdamW script | CPU-s (cold / warm) | warm / cold CPU | wall s (cold / warm) |"
          " failure to restarted worker, s (cold / warm) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()

"""What a lost replica costs: unison's `distrib_ctx(fault_tolerant=True)` beside torchft used directly
and beside today's restart-based recovery; and what fault tolerance costs per step when nothing fails.

    python benchmarks/fault_tolerant.py                 # 2 interleaved rounds; updates its RESULTS.md section
    python benchmarks/fault_tolerant.py --rounds 1 --no-write
    python benchmarks/fault_tolerant.py --steps-only --rounds 7   # only the per-step figures

3 replica groups of 1 process on gloo, a lighthouse in this process (`--min_replicas 2
--quorum_tick_ms 100 --join_timeout_ms 2000`), the MLP of tests/fault_scripts/ft_replica.py
(global batch 12, AdamW). Each round runs, in this order:
- per-step time, nothing failing: unison fault-tolerant (3 replicas; a quorum every 0.5 s, the
  default, and a quorum every step, `quorum_interval=0`), torchft direct
  (benchmarks/torchft_direct.py, 3 replicas), unison DDP (`unison launch --nproc 3`, 4 rows per
  rank), and one plain process (the whole batch of 12); the median interval between committed
  steps after the first 5 (and the mean, which counts the rare quorum steps). Every process runs
  1 torch thread (`OMP_NUM_THREADS=1`, what `unison launch` gives 3 workers on 2 cores): with
  torch's default of every core per process, 3 replicas on 2 cores spun their threads against
  each other and a step took 50-120 ms;
- a kill: replica r2 SIGKILLs itself mid-step at step 20 of 128 and a replacement is started
  as soon as it is gone. Stall: the survivors' gap between the committed steps around the kill,
  less their median step. Rejoin: from the kill to the replacement's first committed step
  (its Python, torch and torchft start-up included);
- today's recovery: `unison launch --nproc 3 --max-restarts 1 tests/fault_scripts/resumable.py`
  with rank 1 SIGKILLed at step 5 (Checkpoint every step), less the same job without a kill.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPLICA = ROOT / "tests" / "fault_scripts" / "ft_replica.py"
DIRECT = HERE / "torchft_direct.py"
RESUMABLE = ROOT / "tests" / "fault_scripts" / "resumable.py"
SECTION = "## Fault tolerance on torchft (`python benchmarks/fault_tolerant.py`)"
STEPS_SECTION = "## Fault tolerance with nothing failing (`python benchmarks/fault_tolerant.py --steps-only`)"


def start(script: Path, out: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(script), "--out", str(out), *args], env=env, stdout=log, stderr=log
        )


def replicas(
    script: Path, tmp: Path, args: list[str], env: dict[str, str], die_at: int | None = None
) -> dict:
    """Three replicas and a fresh lighthouse; with `die_at`, r2 kills itself there and a replacement
    starts once it is gone."""
    from unison.distributed.fault_tolerant import LIGHTHOUSE_ENV, start_lighthouse

    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=100)
    try:
        return _replicas(script, tmp, args, {**env, LIGHTHOUSE_ENV: lighthouse.address()}, die_at)
    finally:
        lighthouse.shutdown()


def _replicas(script: Path, tmp: Path, args: list[str], env: dict[str, str], die_at: int | None) -> dict:
    procs = {f"r{r}": start(script, tmp / f"r{r}.pt", ["--replica", f"r{r}", *args], env) for r in (0, 1)}
    doomed_args = ["--replica", "r2", *args, *(["--die-at", str(die_at)] if die_at is not None else [])]
    doomed = start(script, tmp / ("r2-killed.pt" if die_at is not None else "r2.pt"), doomed_args, env)
    dead_at = None
    if die_at is not None:
        doomed.wait(timeout=300)
        dead_at = time.time()
        procs["r2"] = start(script, tmp / "r2.pt", ["--replica", "r2", *args], env)
    else:
        procs["r2"] = doomed
    for name, p in procs.items():
        if p.wait(timeout=300) != 0:
            raise RuntimeError(
                f"{script.name} {name} failed:\n{Path(f'{tmp / name}.pt.log').read_text()[-3000:]}"
            )
    runs = {name: torch.load(tmp / f"{name}.pt") for name in procs}
    return {"runs": runs, "dead_at": dead_at}


def median_step(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times[5:], times[6:], strict=False)]
    return statistics.median(gaps)


def mean_step(times: list[float]) -> float:
    return (times[-1] - times[5]) / (len(times) - 6)


#: The per-step runs, nothing failing: name, script, extra arguments (all 3 replicas).
STEP_RUNS = (
    ("unison_ft", REPLICA, ["--start-replicas", "3"]),
    ("unison_ft_every", REPLICA, ["--start-replicas", "3", "--quorum-interval", "0"]),
    ("torchft", DIRECT, []),
    ("torchft_lean", DIRECT, ["--lean"]),
)


def kill_figures(result: dict) -> tuple[float, float, float]:
    dead, runs = result["dead_at"], result["runs"]
    times = runs["r0"]["times"]
    before = max(t for t in times if t <= dead)
    after = min(t for t in times if t > dead)
    stall = after - before - median_step(times)
    rejoin = runs["r2"]["times"][0] - dead
    startup = runs["r2"]["imported"] - dead  # Python and the imports, before any joining
    return stall, rejoin, startup


def timed(cmd: list[str], env: dict[str, str], tmp: Path) -> float:
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.time() - t0


def one_round(env: dict[str, str], steps_only: bool = False) -> dict[str, float]:
    got: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, script, extra in STEP_RUNS:
            (tmp / name).mkdir()
            args = ["--epochs", "4", "--min-replicas", "2", *extra]
            times = replicas(script, tmp / name, args, env)["runs"]["r0"]["times"]
            got[f"{name}_step"], got[f"{name}_mean"] = median_step(times), mean_step(times)
        launch = [
            sys.executable,
            "-m",
            "unison.launch",
            "--nproc",
            "3",
            str(REPLICA),
            "--ddp",
            "--batch-size",
            "4",
        ]
        subprocess.run(
            [*launch, "--out", str(tmp / "ddp.pt"), "--epochs", "4"], env=env, check=True, timeout=300
        )
        times = torch.load(tmp / "ddp.pt")["times"]
        got["ddp_step"], got["ddp_mean"] = median_step(times), mean_step(times)
        subprocess.run(
            [sys.executable, str(REPLICA), "--plain", "--out", str(tmp / "plain.pt"), "--epochs", "4"],
            env=env,
            check=True,
            timeout=300,
        )
        got["plain_step"] = median_step(torch.load(tmp / "plain.pt")["times"])
        if steps_only:
            return got
        for name, script in (("unison_ft", REPLICA), ("torchft", DIRECT)):
            (tmp / f"{name}-kill").mkdir()
            args = ["--epochs", "8", "--min-replicas", "2"]
            result = replicas(script, tmp / f"{name}-kill", args, env, die_at=20)
            got[f"{name}_stall"], got[f"{name}_rejoin"], got[f"{name}_startup"] = kill_figures(result)
        job = [sys.executable, "-m", "unison.launch", "--nproc", "3", "--max-restarts", "1", str(RESUMABLE)]
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        killed = timed([*job, "--dir", str(tmp / "a"), "--kill-rank", "1", "--at", "5"], env, tmp)
        clean = timed([*job, "--dir", str(tmp / "b")], env, tmp)
        got["restart_lost"] = killed - clean
    return got


def section(rounds: list[dict[str, float]], load: str) -> str:
    def med(key: str) -> str:
        values = [r[key] for r in rounds]
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    def kill_row(name: str) -> str:
        return f"{med(name + '_stall')} | {med(name + '_rejoin')} | {med(name + '_startup')}"

    return f"""{SECTION}

Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, torchft 0.2.0, gloo;
{len(rounds)} interleaved rounds, median (min-max); load average before the run: {load}.
3 replica groups of 1 process, lighthouse `--min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 2000`
in the benchmark's process; the MLP of tests/fault_scripts/ft_replica.py, global batch 12, AdamW.

| a lost replica | survivors' stall s | replacement's 1st step after the kill s | of which start-up s |
| --- | ---: | ---: | ---: |
| unison `distrib_ctx(fault_tolerant=True)` | {kill_row("unison_ft")} |
| torchft direct (`benchmarks/torchft_direct.py`) | {kill_row("torchft")} |
| today: `--max-restarts 1`, `Checkpoint(every=1)` | job: {med("restart_lost")} lost | every rank restarts | |

Neither fault-tolerant run restarts the survivors. The rejoin time includes the replacement's
start-up (Python and its imports: torch, torchft, unison), shown apart; it was started as soon as
the killed process was gone. "Time lost" for the restart is the job's wall time
with a rank SIGKILLed at step 5 less the same job without a kill (tests/fault_scripts/resumable.py).
torchft direct all-reduces each gradient with `Manager.allreduce`, not through torchft's
`DistributedDataParallel`: in torchft 0.2.0 that wrapper's comm hook fails with `AssertionError`
(torchft/ddp.py:76, `assert fut._fut`) when a peer dies mid-all-reduce, which ends the survivor.

{step_table(rounds)}

Read the spreads: the 2-core machine was shared with other jobs (see the load average), so a
process's share of the CPU varied from round to round. The plain process, for instance, took from
0.7 ms to tens of ms for the same step. A replacement's start-up competes for the CPU with the
survivors: unison's survivors went on training while it started, while torchft's were still stalled.
"""


def step_table(rounds: list[dict[str, float]]) -> str:
    """The per-step figures, nothing failing: median ms (min-max over rounds), mean ms, and the
    median over rounds of each round's ratio to DDP's median step."""

    def ms(key: str) -> str:
        values = [1000 * r[key] for r in rounds]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    def ratio(key: str) -> str:
        values = [r[key] / r["ddp_step"] for r in rounds]
        return f"**{statistics.median(values):.2f}x** ({min(values):.2f}-{max(values):.2f})"

    def row(label: str, name: str) -> str:
        return f"| {label} | {ms(name + '_step')} | {ms(name + '_mean')} | {ratio(name + '_step')} |"

    return "\n".join(
        [
            "| per step, nothing failing | median ms (min-max) | mean ms | median / DDP's (min-max) |",
            "| --- | ---: | ---: | ---: |",
            f"| one plain process, the whole batch of 12 | {ms('plain_step')} | | |",
            row("unison DDP, 3 processes x 4 rows (`unison launch --nproc 3`)", "ddp"),
            row("torchft direct, 3 replicas (async quorum every step, `Manager.allreduce`)", "torchft"),
            row("torchft direct `--lean`: floor (quorum on failure, 1 all-reduce, vote)", "torchft_lean"),
            row("unison fault-tolerant, a quorum each step (`quorum_interval=0`, before)", "unison_ft_every"),
            row("unison fault-tolerant, a quorum every 0.5 s (the default: after)", "unison_ft"),
        ]
    )


def steps_section(rounds: list[dict[str, float]], load: str) -> str:
    return f"""{STEPS_SECTION}

Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, torchft 0.2.0, gloo;
{len(rounds)} interleaved rounds (each: unison FT, unison FT with a quorum every step, torchft
direct, torchft direct `--lean`, DDP, one plain process), median (min-max); load average before
the run: {load}.
3 replica groups of 1 process (1 torch thread each), lighthouse `--min_replicas 2 --quorum_tick_ms
100 --join_timeout_ms 2000` in the benchmark's process; the MLP of tests/fault_scripts/ft_replica.py,
global batch 12, AdamW, 64 steps; a step is the interval between two committed steps (after the 5th).

{step_table(rounds)}
"""


def write_section(title: str, text: str) -> None:
    """Replace (or append) the section headed `title` in benchmarks/RESULTS.md."""
    results = HERE / "RESULTS.md"
    old = results.read_text()
    if title in old:
        head, rest = old.split(title, 1)
        tail = rest[rest.find("\n## ") :] if "\n## " in rest else "\n"
        new = head + text + "\n" + tail.lstrip("\n") if tail.strip() else head + text
    else:
        new = old.rstrip("\n") + "\n\n" + text
    results.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--steps-only", action="store_true", help="only the per-step figures (nothing fails)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    load = open("/proc/loadavg").read().split()[:3]
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    threads = {"OMP_NUM_THREADS": "1"}  # 3 replicas on a 2-core machine, as `unison launch --nproc 3` sets
    rounds = []
    for i in range(args.rounds):
        env = {**os.environ, **threads, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        rounds.append(one_round(env, steps_only=args.steps_only))
        print(f"round {i}: {rounds[-1]}", flush=True)
    title, text = (STEPS_SECTION, steps_section) if args.steps_only else (SECTION, section)
    text = text(rounds, " ".join(load))
    print(text)
    if not args.no_write:
        write_section(title, text)


if __name__ == "__main__":
    main()

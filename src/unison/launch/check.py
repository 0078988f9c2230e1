"""`unison check-exact`: prove that W processes train the user's own script as one process does.

    unison check-exact --nproc 2 --steps 5 --float64 train.py --epochs 3
    unison check-exact --nproc 4 --batch-arg bs train.py --bs 256     # --bs is per process

It runs the script under `unison launch`, on 1 process and on W, with `UNISON_EXACT_PROBE` set:
the script's first `Learner.fit` stops after `--steps` optimizer steps and rank 0 records the
weights, each step's loss and the metrics (`unison.callbacks.exactness_probe`). With `--float64`
the same two runs are made again in float64. The report gives the largest difference in
weights (and which parameters), per-step losses and metrics, and a verdict:

- with `--float64`: "exact to float noise" when the float64 runs agree to `--rtol` (default
  1e-8, relative), else "DIVERGES", naming the parameters that differ;
- without it: "agrees to float32 rounding" within `--rtol` (default 1e-5), else "DIFFERS"
  (run again with `--float64` to tell amplified float noise from a real divergence).

Exit status: 0 when they agree, 1 when they diverge, 2 when no comparison could be made (a run
failed, the two runs did not use the same global batch, or did not start from the same weights).

The global batch must be the same in both runs. unison's loaders give each process the
loader's batch size, so a script keeps the global batch constant by dividing it by
`num_distrib()` itself, or takes the per-process batch as an option that `--batch-arg NAME`
divides by W on the W-process run. A script that does neither is refused, with both numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CheckError", "Comparison", "compare", "main", "scale_batch_arg"]

#: Default tolerances (relative) of the decisive comparison. float64 rounding (2e-16) amplified
#: stays far below 1e-8: a deep BatchNorm stack measured 1.5e-14; a bias before a BatchNorm under
#: AdamW (its zero gradient's rounding noise divided by eps = 1e-8) 1e-10 after 8 steps, growing
#: with steps. A real divergence does not shrink with precision: 2.7e-3 in the tests' example.
RTOL_FLOAT64 = 1e-8
RTOL_FLOAT32 = 1e-5
#: A gradient at most this many epsilons of its dtype times the model's largest is rounding noise.
NOISE_EPSILONS = 100
#: How many parameters the report names.
TOP = 5
#: How many steps' losses the report lists.
LOSS_ROWS = 20


class CheckError(Exception):
    """No comparison could be made (exit status 2); the message says why and what to do."""


# ---- the command line -------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    what = "Run a script's first --steps optimizer steps on 1 and on NPROC processes; compare them."
    after = "The rest of the script does not run. Exit status: 0 agree, 1 diverge, 2 no comparison."
    parser = argparse.ArgumentParser(prog="unison check-exact", description=what, epilog=after)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the parallel run (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    parser.add_argument(
        "--float64", action="store_true", help="also run both in float64: tells float noise from divergence"
    )
    parser.add_argument(
        "--batch-arg",
        metavar="NAME",
        help="the script's option holding the per-process batch size (e.g. bs for --bs 64): "
        "divided by NPROC on the parallel run, so both runs have the same global batch",
    )
    tols = f"default {RTOL_FLOAT64:g} in float64, {RTOL_FLOAT32:g} without --float64"
    parser.add_argument("--rtol", type=float, help=f"largest relative difference that agrees ({tols})")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs' logs and records in DIR")
    parser.add_argument("-m", "--module", action="store_true", help="the target is a module (python -m)")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def scale_batch_arg(args: Sequence[str], name: str, nproc: int) -> list[str]:
    """`args` with the value of `--name` (or `--name=`) divided by `nproc`.

    >>> scale_batch_arg(["--bs", "64", "--epochs", "1"], "bs", 2)
    ['--bs', '32', '--epochs', '1']
    """
    flag = "--" + name.lstrip("-")
    out = list(args)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            value, put = out[i + 1], (lambda v, i=i: out.__setitem__(i + 1, v))
        elif arg.startswith(flag + "="):
            value, put = arg[len(flag) + 1 :], (lambda v, i=i: out.__setitem__(i, f"{flag}={v}"))
        else:
            continue
        try:
            batch = int(value)
        except ValueError:
            raise CheckError(f"--batch-arg {name}: {flag} {value!r} is not a whole number") from None
        if batch % nproc:
            raise CheckError(
                f"--batch-arg {name}: a batch of {batch} does not split evenly over {nproc} processes"
            )
        put(str(batch // nproc))
        return out
    raise CheckError(f"--batch-arg {name}: the script's arguments have no {flag} (got: {' '.join(args)})")


# ---- the runs -----------------------------------------------------------------------------
@dataclass
class Run:
    nproc: int
    float64: bool
    record: Path
    log: Path
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{_procs(self.nproc)}, {'float64' if self.float64 else 'float32'}"


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join("    " + line for line in lines[-n:])


def run_once(run: Run, opts: argparse.Namespace, steps: int) -> dict[str, Any]:
    """Launch the script for `run` and return its record (CheckError when none was written)."""
    args = list(opts.args)
    if opts.batch_arg and run.nproc > 1:
        args = scale_batch_arg(args, opts.batch_arg, run.nproc)
    cmd = [sys.executable, "-m", "unison.launch", "--nproc", str(run.nproc)]
    cmd += ["-m"] if opts.module else []
    cmd += [opts.script, *args]
    from unison.callbacks.exactness_probe import FLOAT64_ENV, PROBE_ENV, STEPS_ENV

    env = {**os.environ, PROBE_ENV: str(run.record), STEPS_ENV: str(steps)}
    env.pop(FLOAT64_ENV, None)
    if run.float64:
        env[FLOAT64_ENV] = "1"
    start = time.monotonic()
    with open(run.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            status = proc.wait(timeout=opts.run_timeout)
        except BaseException as exc:  # past the time limit, or Ctrl-C: leave no launcher behind
            proc.terminate()  # the launcher stops its workers on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            proc.kill()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise CheckError(
                f"the run on {run.label} did not finish in {opts.run_timeout:g}s; its output ends:\n"
                f"{_tail(run.log)}"
            ) from None
    run.seconds = time.monotonic() - start
    if status != 0:
        raise CheckError(
            f"the run on {run.label} failed (exit status {status}); its output ends:\n{_tail(run.log)}"
        )
    if not run.record.exists():
        raise CheckError(
            f"the run on {run.label} ended without training: check-exact stops the script's first "
            "Learner.fit, and none ran (a script that trains without unison's Learner cannot be "
            f"checked). Its output ends:\n{_tail(run.log)}"
        )
    import torch

    return torch.load(run.record, weights_only=True)


# ---- the comparison -------------------------------------------------------------------------
def _rel(diff: float, a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def _diff(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)


@dataclass
class Comparison:
    """The differences between a 1-process record and a W-process record of the same dtype.

    `weights`: (name, max |dw|, relative) per tensor, relative to the tensor's largest entry,
    most different first; `losses`: (step, loss 1, loss W, |d|) per step; `metrics`:
    (name, value 1, value W, |d|) for the last recorded epoch row.
    """

    weights: list[tuple[str, float, float]] = field(default_factory=list)
    losses: list[tuple[int, float, float, float]] = field(default_factory=list)
    metrics: list[tuple[str, float, float, float]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def max_abs_weight(self) -> float:
        return max((d for _, d, _ in self.weights), default=0.0)

    @property
    def max_rel_weight(self) -> float:
        return max((r for _, _, r in self.weights), default=0.0)

    @property
    def max_rel(self) -> float:
        """The largest relative difference of the weights and the per-step losses."""
        rels = [self.max_rel_weight, *(_rel(d, a, b) for _, a, b, d in self.losses)]
        return max(rels) if not self.missing else math.inf

    @property
    def max_rel_metric(self) -> float:
        """The largest relative difference of the epoch values (train_loss, valid_loss, metrics)."""
        return max((_rel(d, a, b) for _, a, b, d in self.metrics), default=0.0)

    def diverging(self, rtol: float) -> list[str]:
        """The tensors whose relative difference exceeds `rtol`, most different first."""
        return [name for name, _, rel in self.weights if rel > rtol]


def compare(one: dict[str, Any], many: dict[str, Any]) -> Comparison:
    """Compare the records of a 1-process run and a W-process run."""
    import torch

    result = Comparison()
    w1, ww = one["weights"], many["weights"]
    result.missing = sorted(set(w1) ^ set(ww))
    for name in w1:
        if name not in ww:
            continue
        a, b = w1[name], ww[name]
        if a.shape != b.shape:
            result.missing.append(f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})")
            continue
        if a.numel() == 0:
            result.weights.append((name, 0.0, 0.0))
            continue
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        same = (a64 == b64) | (a64.isnan() & b64.isnan())  # equal infinities and NaNs: no difference
        gaps = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs()).nan_to_num(nan=math.inf)
        diff = float(gaps.max())
        scale = max(float(a64.abs().max().nan_to_num()), float(b64.abs().max().nan_to_num()))
        result.weights.append((name, diff, _rel(diff, scale, 0.0)))
    result.weights.sort(key=lambda t: (-t[2], -t[1], t[0]))
    for i, (a, b) in enumerate(zip(one["losses"], many["losses"], strict=False), start=1):
        result.losses.append((i, a, b, _diff(a, b)))
    if one["values"] and many["values"]:
        names = ["train_loss", "valid_loss", *one["metric_names"][2:]]
        for name, a, b in zip(names, one["values"][-1], many["values"][-1], strict=False):
            result.metrics.append((name, a, b, _diff(a, b)))
    return result


def preflight(one: dict[str, Any], many: dict[str, Any], nproc: int, batch_arg: str | None) -> None:
    """Refuse (CheckError) two runs that were not set up to be equal."""
    if many["world_size"] != nproc or one["world_size"] != 1:
        raise CheckError(
            f"the script's Learner trained on {one['world_size']} and {many['world_size']} process(es), "
            f"not 1 and {nproc}: train inside `with learn.distrib_ctx():` so that the processes share "
            "the work"
        )
    bs1, bsw = one["batch_size"], many["batch_size"]
    if bs1 is not None and bsw is not None and bs1 != bsw * nproc:
        hint = (
            f"--batch-arg {batch_arg} did not reach the loader"
            if batch_arg
            else "divide the batch by unison.distributed.num_distrib() in the script, or pass "
            "--batch-arg NAME if an option of the script sets the per-process batch"
        )
        raise CheckError(
            f"the global batch differs: 1 process trained on batches of {bs1}, {nproc} processes on "
            f"{nproc} x {bsw} = {nproc * bsw}. They cannot be compared: {hint}"
        )
    if one["steps"] != many["steps"]:
        raise CheckError(
            f"the runs took {one['steps']} and {many['steps']} optimizer steps: with the same global "
            "batch both take the same number"
        )
    start1, startw = one["initial"], many["initial"]
    differ = [n for n in start1 if n in startw and not bool((start1[n] == startw[n]).all())]
    if differ:
        raise CheckError(
            f"the two runs started from different weights ({', '.join(differ[:TOP])}"
            f"{', ...' if len(differ) > TOP else ''}): seed the script before building the model "
            "(unison.set_seed) so that every run starts from the same ones"
        )


# ---- the report ---------------------------------------------------------------------------------
def _procs(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def describe(cmp: Comparison, nproc: int, dtype: str, rtol: float | None) -> list[str]:
    """The report's lines for one dtype."""
    lines = [f"{dtype}:"]
    if cmp.missing:
        lines.append(f"  tensors in only one run: {', '.join(cmp.missing)}")
    if cmp.weights:
        name, d, r = cmp.weights[0]
        lines.append(f"  weights: max |dw| {cmp.max_abs_weight:.2e}; largest relative {r:.2e}, in {name}")
        shown = [w for w in cmp.weights[:TOP] if w[1] > 0]
        if shown:
            width = max(len(n) for n, _, _ in shown)
            lines.append("    most different tensors (max |dw|, relative to the tensor's largest entry):")
            for n, d, r in shown:
                flag = "  <- diverges" if rtol is not None and r > rtol else ""
                lines.append(f"      {n.ljust(width)}  {d:.2e}  {r:.2e}{flag}")
    if cmp.losses:
        worst = max(cmp.losses, key=lambda t: t[3])
        lines.append(
            f"  losses ({len(cmp.losses)} steps): max |dloss| {worst[3]:.2e} at step {worst[0]} "
            f"(relative {_rel(worst[3], worst[1], worst[2]):.2e})"
        )
        lines.append(f"    step  {'1 process':>14}  {_procs(nproc):>14}  {'|d|':>9}")
        for step, a, b, d in cmp.losses[:LOSS_ROWS]:
            lines.append(f"    {step:<4}  {a:>14.8g}  {b:>14.8g}  {d:>9.2e}")
        if len(cmp.losses) > LOSS_ROWS:
            lines.append(f"    ... ({len(cmp.losses) - LOSS_ROWS} more)")
    if cmp.metrics:
        cells = [f"{n} {a:.6g} vs {b:.6g} (|d| {d:.2e})" for n, a, b, d in cmp.metrics]
        lines.append("  after the last step: " + "; ".join(cells))
    return lines


def _names(cmp: Comparison, tol: float) -> str:
    names = cmp.diverging(tol)
    if not names:  # only the losses or the metrics differ
        return "no single tensor beyond the tolerance (the losses or metrics differ)"
    more = f" and {len(names) - TOP} more" if len(names) > TOP else ""
    return ", ".join(names[:TOP]) + more


def verdict(cmp32: Comparison, cmp64: Comparison | None, nproc: int, rtol: float | None) -> tuple[int, str]:
    """(exit status, verdict line).

    Weights and per-step losses are judged at `rtol` (float64: 1e-8, float32: 1e-5 by default).
    The epoch values (train_loss, valid_loss, metrics) are judged at float32's tolerance in
    both cases: unison reduces them over ranks in float32 whatever the model's dtype.
    """
    procs = _procs(nproc)
    decisive = cmp64 if cmp64 is not None else cmp32
    tol = (RTOL_FLOAT64 if cmp64 is not None else RTOL_FLOAT32) if rtol is None else rtol
    metric_tol = max(tol, RTOL_FLOAT32)
    gap, metric_gap = decisive.max_rel, decisive.max_rel_metric
    agree = gap <= tol and metric_gap <= metric_tol
    weights = f"{gap:.1e} relative ({'<=' if gap <= tol else '>'} {tol:g})"
    metric_note = ""
    if decisive.metrics:  # judged at their own tolerance, stated beside their figure
        why = "" if metric_tol == tol else ": unison reduces them in float32"
        sign = "<=" if metric_gap <= metric_tol else ">"
        metric_note = f", metrics to {metric_gap:.1e} ({sign} {metric_tol:g}{why})"
    if cmp64 is not None:
        if agree:
            return 0, (
                f"exact to float noise: in float64, {procs} agree with 1 to {weights}{metric_note}; "
                f"the float32 difference ({cmp32.max_rel:.1e} relative) is rounding"
            )
        return 1, (
            f"DIVERGES: in float64, {procs} differ from 1 by {weights}{metric_note}: not float noise. "
            f"Diverging: {_names(decisive, tol)}"
        )
    if agree:
        return 0, (
            f"agrees to float32 rounding: {procs} and 1 differ by {weights}{metric_note}; --float64 "
            "proves it is float noise"
        )
    return 1, (
        f"DIFFERS: {procs} and 1 differ by {weights}{metric_note}, most in {_names(decisive, tol)}. Run "
        "again with --float64: float64 agreeing means amplified float noise (deep BatchNorm stacks do "
        "this), not agreeing means a real divergence"
    )


def rounding_noise_gradients(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Parameters whose gradient was rounding noise in every run of `records`, with its largest size.

    Each record holds, per parameter, the largest over steps of max|grad| relative to the
    model's largest gradient (`grad_ratio`). A parameter whose true gradient is zero (a bias
    that a following BatchNorm cancels) has a computed gradient of float noise: measured 0.4
    to 0.6 of the dtype's epsilon (8.5e-17 in float64, 7e-8 in float32); a real gradient is
    orders of magnitude above NOISE_EPSILONS epsilons.

    >>> rounding_noise_gradients([{"float64": True, "grad_ratio": {"0.bias": 8.5e-17, "0.weight": 0.55}}])
    {'0.bias': 8.5e-17}
    """
    found: dict[str, float] = {}
    for i, record in enumerate(records):
        ratios = record.get("grad_ratio") or {}
        eps = 2.0**-52 if record.get("float64") else 2.0**-23
        noise = {n: r for n, r in ratios.items() if r <= NOISE_EPSILONS * eps}
        if i == 0:
            found = noise
        found = {n: max(r, noise[n]) for n, r in found.items() if n in noise}
    return found


def noise_hint(noise: dict[str, float], differing: Sequence[str], dtype: str) -> str | None:
    """One line naming the parameters of `differing` whose gradient is rounding noise, or None.

    >>> noise_hint({"0.bias": 8.5e-17}, ["0.bias", "1.running_mean"], "float64")
    "hint: 0.bias's gradient is zero but for rounding (at most 8.5e-17 of the largest, in float64): ..."
    """
    named = list(dict.fromkeys(n for n in differing if n in noise))
    if not named:
        return None
    whose = f"{named[0]}'s gradient is" if len(named) == 1 else f"the gradients of {', '.join(named)} are"
    return (
        f"hint: {whose} zero but for rounding (at most {max(noise[n] for n in named):.1e} of the model's "
        f"largest, in {dtype}): the likely cause of this difference. A parameter whose true gradient is "
        "zero, such as a bias that a following BatchNorm cancels, gets float noise that Adam and AdamW "
        "turn into full-size steps, different for every summation order: build that layer with "
        "bias=False (docs/exact.md, When float noise grows)"
    )


def check(opts: argparse.Namespace, out: Path) -> int:
    """Run, compare and print the report; return the exit status."""
    if opts.nproc < 2:
        raise CheckError(f"--nproc must be at least 2 (got {opts.nproc}): the check compares 1 and NPROC")
    if opts.steps < 1:
        raise CheckError(f"--steps must be at least 1 (got {opts.steps})")
    if not opts.module and not Path(opts.script).is_file():
        raise CheckError(f"no such script: {opts.script}")
    if opts.batch_arg:
        scale_batch_arg(opts.args, opts.batch_arg, opts.nproc)  # refuse a bad option before any run
    target = " ".join([opts.script, *opts.args])
    print(
        f"unison check-exact: {target}: {opts.steps} optimizer step(s), 1 process vs {opts.nproc}", flush=True
    )
    dtypes = [False, True] if opts.float64 else [False]
    records: dict[tuple[int, bool], dict[str, Any]] = {}
    for float64 in dtypes:
        for nproc in (1, opts.nproc):
            tag = f"{nproc}p-{'float64' if float64 else 'float32'}"
            run = Run(nproc, float64, out / f"{tag}.pt", out / f"{tag}.log")
            print(f"  running on {run.label} ...", end="", flush=True)
            try:
                records[nproc, float64] = run_once(run, opts, opts.steps)
            except CheckError:
                print(" failed", flush=True)
                raise
            print(f" {run.seconds:.1f}s", flush=True)
        preflight(records[1, float64], records[opts.nproc, float64], opts.nproc, opts.batch_arg)
    one = records[1, False]
    steps = one["steps"]
    bs = one["batch_size"]
    batch = f", global batch {bs}" if bs is not None else ""
    note = "" if steps == opts.steps else f" (the fit ended after {steps} of the {opts.steps} asked)"
    print(f"compared after {steps} optimizer step(s){note}{batch}")
    cmp32 = compare(records[1, False], records[opts.nproc, False])
    cmp64 = compare(records[1, True], records[opts.nproc, True]) if opts.float64 else None
    tol64 = RTOL_FLOAT64 if opts.rtol is None else opts.rtol
    tol32 = None if opts.float64 else (RTOL_FLOAT32 if opts.rtol is None else opts.rtol)
    print("\n".join(describe(cmp32, opts.nproc, "float32 (as the script runs)", tol32)))
    if cmp64 is not None:
        print("\n".join(describe(cmp64, opts.nproc, "float64", tol64)))
    status, line = verdict(cmp32, cmp64, opts.nproc, opts.rtol)
    print(f"verdict: {line}", flush=True)
    # The tensors beyond float32's tolerance (or, in float64, beyond --rtol), and whether one of
    # them is a parameter whose gradient is pure rounding noise: that explains the difference.
    differing = [n for n, _, rel in cmp32.weights if rel > (tol32 or RTOL_FLOAT32)]
    differing += cmp64.diverging(tol64) if cmp64 is not None else []
    dtype = "float64" if opts.float64 else "float32"
    hint = noise_hint(
        rounding_noise_gradients([records[1, opts.float64], records[opts.nproc, opts.float64]]),
        differing,
        dtype,
    )
    if hint is not None:
        print(hint, flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `unison check-exact`; returns the exit status (0 agree, 1 diverge, 2 no comparison)."""
    opts = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="unison-check-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        return check(opts, out)
    except CheckError as exc:
        print(f"unison check-exact: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if not opts.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""`unison check-exact`: prove that W processes train the user's own script as one process does.

    unison check-exact --nproc 2 --steps 5 --float64 train.py --epochs 3
    unison check-exact --nproc 4 --batch-arg bs train.py --bs 256     # --bs is per process

It runs the script under `unison launch` (a new interpreter each time, or a fork of this process
where it preloaded torch: `check.forked_launch`), on 1 process and on W, with `UNISON_EXACT_PROBE` set:
the script's first `Learner.fit` stops after `--steps` optimizer steps and rank 0 records the
weights, each step's loss and the metrics (`unison.callbacks.exactness_probe`). With `--float64`
the same two runs are made again in float64 (`--float64-only`: those alone). The report gives
the largest difference in weights (and which parameters), per-step losses and metrics, and a
verdict:

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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.check import forked_launch
from unison.check.report import (
    RTOL_FLOAT32,
    RTOL_FLOAT64,
    TOP,
    compare,
    describe,
    noise_hint,
    procs,
    rounding_noise_gradients,
    verdict,
)
from unison.env_names import FLOAT64_ENV, PROBE_ENV, STEPS_ENV

__all__ = ["CheckError", "compare", "main", "scale_batch_arg", "verdict"]


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
        "--float64-only",
        action="store_true",
        help="run the two float64 runs alone (where the float32 ones were compared already)",
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


# ---- the runs and what they must share ------------------------------------------------------
@dataclass
class Run:
    nproc: int
    float64: bool
    record: Path
    log: Path
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{procs(self.nproc)}, {'float64' if self.float64 else 'float32'}"


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
    launch_args = ["--nproc", str(run.nproc), *(["-m"] if opts.module else []), opts.script, *args]
    env = {**os.environ, PROBE_ENV: str(run.record), STEPS_ENV: str(steps)}
    env.pop(FLOAT64_ENV, None)
    if run.float64:
        env[FLOAT64_ENV] = "1"
    start = time.monotonic()
    with open(run.log, "w") as log:
        proc = forked_launch.start(launch_args, env, log)
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
            "Learner.fit (or Run's epochs), and none ran (a script that trains without unison cannot be "
            f"checked). Its output ends:\n{_tail(run.log)}"
        )
    import torch

    return torch.load(run.record, weights_only=True)


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


def global_batch(record: dict[str, Any]) -> str:
    """The 1-process record's global batch, as the report names it ('' when the loader has none).

    >>> global_batch({"batch_size": 32, "accumulate": 2})
    ', global batch 64 (2 accumulated batches of 32)'
    """
    bs, k = record["batch_size"], record.get("accumulate", 1)
    if bs is None:
        return ""
    return f", global batch {bs * k} ({k} accumulated batches of {bs})" if k > 1 else f", global batch {bs}"


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
    opts.float64 = opts.float64 or opts.float64_only
    dtypes = [True] if opts.float64_only else [False, True] if opts.float64 else [False]
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
    one = records[1, dtypes[0]]
    steps = one["steps"]
    if steps == 0:
        raise CheckError(
            "the runs took 0 optimizer steps: nothing was compared (the fit ended before its first step: "
            "its epochs were done already, or its loader is empty)"
        )
    note = "" if steps == opts.steps else f" (the fit ended after {steps} of the {opts.steps} asked)"
    print(f"compared after {steps} optimizer step(s){note}{global_batch(one)}")
    cmp32 = compare(records[1, False], records[opts.nproc, False]) if False in dtypes else None
    cmp64 = compare(records[1, True], records[opts.nproc, True]) if opts.float64 else None
    tol64 = RTOL_FLOAT64 if opts.rtol is None else opts.rtol
    tol32 = None if opts.float64 else (RTOL_FLOAT32 if opts.rtol is None else opts.rtol)
    if cmp32 is not None:
        print("\n".join(describe(cmp32, opts.nproc, "float32 (as the script runs)", tol32)))
    if cmp64 is not None:
        print("\n".join(describe(cmp64, opts.nproc, "float64", tol64)))
    status, line = verdict(cmp32, cmp64, opts.nproc, opts.rtol)
    print(f"verdict: {line}", flush=True)
    # The tensors beyond float32's tolerance (or, in float64, beyond --rtol), and whether one of
    # them is a parameter whose gradient is pure rounding noise: that explains the difference.
    differing = cmp32.diverging(tol32 or RTOL_FLOAT32) if cmp32 is not None else []
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

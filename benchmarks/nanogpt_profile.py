"""Where the nanoGPT port's time per iteration goes inside unison (a profile, not a comparison).

Runs examples/nanogpt/train.py in this process with a wall-clock timer around each of unison's
per-step parts (the events and the callbacks behind them, the exact loss's division, the trimming
of padding, the move to the device) and prints each one's milliseconds per iteration. Timers, not
cProfile: cProfile inflates Python-heavy code several times over against torch's kernels.
`benchmarks/nanogpt_speed.py` is the comparison with the torchrun original.

    OMP_NUM_THREADS=1 python benchmarks/nanogpt_profile.py --max_iters 200 --eval_interval 200
"""

from __future__ import annotations

import functools
import runpy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import unison.engine as engine
import unison.exact_loss as exact_loss
import unison.run as run_module
import unison.run_host as run_host
from unison.callbacks.nonfinite import NonFiniteCheck
from unison.callbacks.training import GradientClip

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "nanogpt" / "train.py"
spent: dict[str, float] = {}


def timed(owner: Any, name: str, label: str) -> None:
    """Replace `owner.name` (a unison function or method) by itself plus a timer, for this run only."""
    func = getattr(owner, name)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    spent[label] = 0.0
    setattr(owner, name, wrapper)


def main() -> None:
    timed(run_host.RunHost, "__call__", "every event (the callbacks below included)")
    timed(GradientClip, "before_step", "  GradientClip (the original clips too)")
    timed(NonFiniteCheck, "before_step", "  NonFiniteCheck.before_step")
    timed(exact_loss.ExactLoss, "normalise_grads", "the gradient / the step's global count")
    timed(run_module.Run, "loss", "run.loss")
    timed(engine, "trim_padding", "trim_padding")
    timed(run_host, "to_device", "to_device")
    timed(engine, "optimizer_step", "the optimizer's step (AdamW, as the original)")
    argv = sys.argv[1:]
    iters = int(argv[argv.index("--max_iters") + 1]) if "--max_iters" in argv else 60
    out_dir = tempfile.mkdtemp(prefix="nanogpt-profile-")  # (fresh: the example resumes a finished run)
    sys.argv = [str(EXAMPLE), "--batch_size", "8", "--out_dir", out_dir, *argv]
    sys.path.insert(0, str(EXAMPLE.parent))
    start = time.perf_counter()
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    total = time.perf_counter() - start
    print(f"\n{iters} iterations, {total / iters * 1000:.2f} ms each with start-up; per iteration:")
    for label, seconds in spent.items():
        print(f"{label:50s} {seconds / iters * 1000:7.3f} ms")


if __name__ == "__main__":
    main()

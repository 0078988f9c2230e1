"""examples/nanogpt/train.py as it is, one of whose ranks SIGKILLs itself once, mid-run (a test).

unison launch --nproc 2 --max-restarts 1 nanogpt_killed.py --kill-rank 1 --kill-after 3 [train.py's arguments]

The example is run unchanged (runpy); the only addition is a callback on its `unison.Run`, attached by
a subclass standing in for `unison.Run` while the example runs: on the first attempt, rank
`--kill-rank` SIGKILLs itself right after optimizer step `--kill-after` (counted from 1), before
that batch's end, where a checkpoint would be written: the newest checkpoint is an earlier one
(tests/test_run_resume.py).
"""

import argparse
import os
import runpy
import signal
import sys
from pathlib import Path

import unison

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nanogpt" / "train.py"

parser = argparse.ArgumentParser()
parser.add_argument("--kill-rank", type=int, required=True)
parser.add_argument("--kill-after", type=int, required=True, help="optimizer steps")
args, example_args = parser.parse_known_args()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class KillAfterStep(unison.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1
        if first_attempt and self.steps == args.kill_after and self.learn.collective.rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)


class KillingRun(unison.Run):
    def __init__(self, **options):
        super().__init__(**options)
        self.add_cb(KillAfterStep())


unison.Run = KillingRun
sys.argv = [str(EXAMPLE), *example_args]
sys.path.insert(0, str(EXAMPLE.parent))  # (the example imports its model module)
runpy.run_path(str(EXAMPLE), run_name="__main__")

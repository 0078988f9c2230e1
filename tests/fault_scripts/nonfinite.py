"""A resumable training script whose data turns NaN on one rank at one step (issue 19 item 2).

unison launch --nproc 2 --max-restarts 2 nonfinite.py --dir D --nan-rank 1 --at 5

The data is the test's (tests/callbacks/test_nonfinite.py), so the test checks the checkpoint
against its own plain loop. The NaN is in the data: a restart would meet it again. Rank 0 copies
the checkpoint right after the save of step `at - 1` to D/step<at-1>.pth.
"""

import argparse
import shutil

from tests.callbacks.test_nonfinite import GLOBAL_BS, Callback, Checkpoint, Poison, _learner
from unison.distributed import num_distrib

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--nan-rank", type=int, default=1)
parser.add_argument("--at", type=int, default=5, help="training step (batch of epoch 0) made NaN")
args = parser.parse_args()


class CopyCheckpoint(Callback):
    order = 95  # after Checkpoint wrote this step

    def after_batch(self):
        learn = self.learn
        if learn.training and learn.epoch == 0 and learn.iter == args.at - 1 and learn.collective.is_main:
            file = learn.get_cb(Checkpoint).file
            shutil.copyfile(file, file.parent.parent / f"step{args.at - 1}.pth")


cbs = [Poison(step=args.at, rank=args.nan_rank), Checkpoint(every=1), CopyCheckpoint()]
learn = _learner(args.dir, GLOBAL_BS // max(1, num_distrib()), cbs=cbs)
with learn.distrib_ctx():
    learn.fit(2, resume=True)
print("FINISHED", flush=True)

"""A slow little fit for the progress-bar tests: 6 training steps of about 0.15 s on each of 2 ranks.

Rank 1 prints `RANK1 line at step K` (stdout) after every training step, so its lines arrive
while rank 0's bars are drawn.

    unison launch --nproc 2 tests/scripts/progress_bars.py     # under the launcher
    python tests/scripts/progress_bars.py --spawn              # under unison.spawn (2 processes)
    unison launch --nproc 2 --max-restarts 1 tests/scripts/progress_bars.py --crash-at 3
                                     # rank 1 dies at step 3 of the first attempt; the restart runs whole
"""

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison
from unison import Callback, DataLoaders, Learner, set_seed
from unison.distributed import rank_distrib

STEPS = 6  # training steps per rank: 48 items, 2 ranks, batch 4


CRASH_AT = int(sys.argv[sys.argv.index("--crash-at") + 1]) if "--crash-at" in sys.argv else -1
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class SlowSteps(Callback):
    def after_batch(self) -> None:
        if (
            self.learn.training
            and self.learn.train_iter == CRASH_AT
            and FIRST_ATTEMPT
            and rank_distrib() == 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.15)  # long enough for the relay to see several redraws of the bar
        if rank_distrib() == 1 and self.learn.training:
            print(f"RANK1 line at step {self.learn.train_iter}", flush=True)


def train() -> int:
    set_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    dls = DataLoaders(
        DataLoader(TensorDataset(x[:48], y[:48]), batch_size=4),
        DataLoader(TensorDataset(x[48:], y[48:]), batch_size=8),
    )
    learn = Learner(dls, nn.Linear(4, 1), nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.1, cbs=[SlowSteps()])
    with learn.distrib_ctx():
        learn.fit(1)
    return STEPS


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        print(f"RESULT {unison.spawn(train, 2)}", flush=True)
    else:
        train()

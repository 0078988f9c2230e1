"""The same training as raw_ddp.py, written with unison's Learner and distrib_ctx."""

import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from workload import BS, EPOCHS, LR, Timer, data, model  # noqa: E402

from unison import Callback, DataLoaders, Learner, ProgressCallback, accuracy  # noqa: E402
from unison.distributed import num_distrib  # noqa: E402

PRECISION = os.environ.get("PRECISION", "fp32")  # fp32 | bf16
DDP_KWARGS = json.loads(os.environ.get("DDP_KWARGS", "{}"))  # e.g. {"gradient_as_bucket_view": true}


class TimeTraining(Callback):
    """Times the training phase of each epoch, as the hand-written loop does."""

    def __init__(self, timer):
        self.timer = timer

    def before_train(self):
        self.timer.start()

    def after_step(self):
        self.timer.stepped()

    def after_train(self):
        self.timer.stop(len(self.learn.dl) * BS * num_distrib())


(xt, yt), (xv, yv) = data()
dls = DataLoaders(
    DataLoader(TensorDataset(xt, yt), batch_size=BS, shuffle=True),
    DataLoader(TensorDataset(xv, yv), batch_size=BS),
)
timer = Timer()
cbs = [TimeTraining(timer)]
if PRECISION != "fp32":
    from unison import MixedPrecision

    cbs.append(MixedPrecision(PRECISION))
learn = Learner(
    dls,
    model(),
    nn.CrossEntropyLoss(),
    opt_func=partial(torch.optim.SGD, momentum=0.9),
    lr=LR,
    metrics=[accuracy],
    cbs=cbs,
)
learn.get_cb(ProgressCallback).show = True  # the default bar, shown even though stderr is a pipe here
learn.recorder.print_table = False
with learn.distrib_ctx(**DDP_KWARGS):
    learn.fit(EPOCHS)
    acc = learn.validate()[1]
timer.report(f"unison_{PRECISION}" if PRECISION != "fp32" else "unison", acc, num_distrib())

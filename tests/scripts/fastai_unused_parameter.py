"""examples/fastai_bridge.py's learner with a layer the model never calls: DDP's own error (a
parameter without a gradient) is what the job reports, not a stalled rank."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fastai_bridge import build  # noqa: E402

from unison.fastai import *  # noqa: E402, F403

learn = build(32)
learn.model.extra = torch.nn.Linear(3, 3)  # never called
with learn.no_bar(), learn.distrib_ctx(timeout=10):
    learn.fit(1)

"""A stock fastai `Learner` trained data-parallel by unison's engine, exactly: `pip install 'unison[fastai]'`.

    from fastai.tabular.all import *
    from unison.fastai import *               # instead of: from fastai.distributed import *
    ...                                       # fastai's own DataLoaders, Learner, metrics, callbacks
    with learn.distrib_ctx():                 # fastai's own line (or: with distrib_ctx(learn):)
        learn.fit_one_cycle(3, 1e-2)

The names are fastai's distributed API with fastai's signatures (`Learner.distrib_ctx`,
`to_distributed`, `detach_distributed`, `to_parallel`, `detach_parallel`, `parallel_ctx`,
`rank0_first`, `setup_distrib`, `teardown_distrib`, `num_distrib`, `rank_distrib`), on CPU and GPU.

Start it with `unison launch --nproc 4 train.py` (or torchrun, srun). On W processes at a per-process
batch `bs` it trains to the weights one fastai process reaches at batch `W*bs`: the same global
order as fastai's own shuffle, BatchNorm synchronised exactly (on CPU too), each step's gradient
that of the global batch, and validation loss, metrics and `get_preds` over every item once (no
padded duplicates). A non-finite loss stops every rank, naming it; a stalled rank is named; rank 0
alone shows progress and logs; with `checkpoint_every=k, resume=True` a killed or preempted job
resumes mid-epoch to the uninterrupted weights. On one process it changes nothing. See
docs/from-fastai.md.
"""

from __future__ import annotations

try:
    import fastai.learner  # noqa: F401
except ImportError as exc:  # one line naming the fix, not a traceback into fastai's absence
    raise ImportError("unison.fastai needs fastai: pip install 'unison[fastai]'") from exc

from unison.distributed.env import num_distrib, rank_distrib
from unison.distributed.group import rank0_first, setup_distrib, teardown_distrib
from unison.fastai.bridge import UnisonBridge
from unison.fastai.distributed import detach_distributed, distrib_ctx, get_bridge, to_distributed
from unison.fastai.learner_methods import ParallelTrainer
from unison.fastai.loader import RankShardedFastaiDL

__all__ = [
    "ParallelTrainer",
    "RankShardedFastaiDL",
    "UnisonBridge",
    "detach_distributed",
    "distrib_ctx",
    "get_bridge",
    "num_distrib",
    "rank0_first",
    "rank_distrib",
    "setup_distrib",
    "teardown_distrib",
    "to_distributed",
]

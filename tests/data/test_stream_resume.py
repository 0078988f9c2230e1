"""Mid-epoch resume on a stream: stopped at a step and resumed, the weights of an uninterrupted run."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from tests.checkpoint.test_callback import Stop, StopAt
from tests.data.test_stream import SelfSharding, Table
from unison import Checkpoint, DataLoaders, Learner, set_seed

N, EPOCHS = 48, 2


class SelfShardingTable(SelfSharding):
    """A table that reads only its rank's rows (the `shard` protocol)."""

    def __init__(self, x, y, rank=0, world_size=1):
        super().__init__(len(x), rank, world_size)
        self.x, self.y = x, y

    def shard(self, rank, world_size):
        return SelfShardingTable(self.x, self.y, rank, world_size)

    def __iter__(self):
        for i in range(self.rank, self.n, self.world_size):
            yield self.x[i], self.y[i]


class StatefulTable(SelfShardingTable):
    """A self-sharding table with `state_dict`/`load_state_dict` (as torchdata's stateful datasets):
    it continues from its saved position, and counts the rows it reads."""

    reads = 0

    def __init__(self, x, y, rank=0, world_size=1):
        super().__init__(x, y, rank, world_size)
        self.position = 0

    def shard(self, rank, world_size):
        return StatefulTable(self.x, self.y, rank, world_size)

    def __len__(self):  # the epoch's length from len(): the loader drains the stream each epoch
        return self.n

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def __iter__(self):
        mine = range(self.rank, self.n, self.world_size)
        start, self.position = self.position, 0
        for k in range(start, len(mine)):
            StatefulTable.reads += 1
            self.position = k + 1
            yield self.x[mine[k]], self.y[mine[k]]
        self.position = 0  # the next epoch starts over


def _learner(path, bs, self_sharding, init_seed=0):
    set_seed(init_seed)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g)
    y = (x.sum(1) > 0).long()
    kinds = {False: Table, True: SelfShardingTable, "stateful": StatefulTable}
    stream = kinds[self_sharding](x, y)
    dls = DataLoaders(DataLoader(stream, batch_size=bs), None)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    steps = N // (bs * (dist.get_world_size() if dist.is_initialized() else 1))
    steps = None if self_sharding == "stateful" else steps
    return Learner(
        dls,
        model,
        nn.CrossEntropyLoss(),
        lr=1e-2,
        path=path,
        cbs=[Checkpoint(every=1)],
        steps_per_epoch=steps,
    )


def _fit(learn, cbs=(), resume=False):
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit_one_cycle(EPOCHS, lr_max=1e-2, cbs=cbs, resume=resume)


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _stop_and_resume(path, bs, distributed, self_sharding, stops):
    ctx = (lambda learn: learn.distrib_ctx()) if distributed else (lambda learn: contextlib.nullcontext())
    reference = _learner(path / "ref", bs, self_sharding)
    with ctx(reference):
        _fit(reference)
    same, reads = [], []
    for at in stops:
        run_dir = path / f"stop{at}"
        first = _learner(run_dir, bs, self_sharding)
        with ctx(first), pytest.raises(Stop):
            _fit(first, cbs=[StopAt(at)])
        resumed = _learner(run_dir, bs, self_sharding, init_seed=99)  # another start: restored from the file
        StatefulTable.reads = 0
        with ctx(resumed):
            _fit(resumed, resume=True)
        reads.append(StatefulTable.reads)
        a, b = _weights(reference), _weights(resumed)
        same.append(all(torch.equal(a[k], b[k]) for k in a))
    return same if self_sharding != "stateful" else (same, reads)


def test_stream_stopped_mid_epoch_resumes_exactly_one_process(tmp_path):
    assert all(_stop_and_resume(tmp_path, 8, False, False, stops=[2, 6, 9]))  # 6 steps an epoch


@pytest.mark.parametrize("self_sharding", [False, True])
def test_stream_stopped_mid_epoch_resumes_exactly_two_processes(pool2, tmp_path, self_sharding):
    for same in pool2.run(_stop_and_resume, tmp_path / str(self_sharding), 8, True, self_sharding, [1, 2, 4]):
        assert same == [True, True, True]


def test_a_stateful_stream_resumes_from_its_state_without_rereading(pool2, tmp_path):
    # 3 steps of 8 rows per rank per epoch; stopped after step 1 or 2 of epoch 0.
    for same, reads in pool2.run(_stop_and_resume, tmp_path, 8, True, "stateful", [1, 2]):
        assert same == [True, True]
        assert reads == [24 - 8 + 24, 24 - 16 + 24]  # the rest of epoch 0 and all of epoch 1: none twice

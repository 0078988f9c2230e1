"""Streams that split themselves (issue 18, items 2 and 3): exact, or refused in one line; never a
silent fraction of the data.

- torch's recipe for DataLoader workers (`get_worker_info` in `__iter__`) is read whole in every
  worker, so the generic path stays exact, on 1 process too.
- A stream split by `torch.distributed.get_rank()` in `__iter__` is refused before any step.
- A Hugging Face stream takes the exact path by default (whatever its shard count); reading 1/W of
  it per rank is `stream_split="by_node"`, said in a log line.
- A self-sharded stream whose parts do not add up to `len()` is refused at the end of the epoch.
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tests.data.test_stream import _allow_loader_workers
from unison import DataLoaders, Learner, set_seed
from unison.data.stream import StreamDL
from unison.distributed.collective import Collective

datasets = pytest.importorskip("datasets")


def _item(i):
    return torch.tensor([float(i)]), torch.tensor(i)


class SplitsByRank(IterableDataset):
    """A recipe for DDP: `__iter__` keeps the items `rank, rank + W, ...` of the process group."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        for i in range(rank, self.n, world):
            yield _item(i)


class SplitsByWorker(IterableDataset):
    """torch's documented recipe: `__iter__` keeps its DataLoader worker's items."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for i in range(worker, self.n, workers):
            yield _item(i)


class ShardIgnoringWorkers(IterableDataset):
    """`shard(rank, world_size)` done halfway: each rank's part, but not split among its workers."""

    def __init__(self, n, rank=0, world_size=1):
        self.n, self.rank, self.world_size = n, rank, world_size

    def __len__(self):
        return self.n

    def shard(self, rank, world_size):
        return ShardIgnoringWorkers(self.n, rank, world_size)

    def __iter__(self):
        for i in range(self.rank, self.n, self.world_size):
            yield _item(i)


def _world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _stream(dataset, bs, workers=0, split="exact", context=None):
    rank, world = _world()
    collective = Collective(dist.group.WORLD) if dist.is_initialized() else None
    dl = DataLoader(dataset, batch_size=bs, num_workers=workers, multiprocessing_context=context)
    return StreamDL(dl, rank, world, collective, split=split)


def _ids_by_step(sdl, key=None):
    """The stream ids of this rank's real rows, step by step."""
    steps = []
    for k, batch in enumerate(sdl):
        ids = batch[key] if key is not None else batch[1]
        steps.append(ids[: sdl.real_rows(k)].tolist())
    return steps


def _gathered(steps):
    """Every rank's ids of each step, joined: the global steps."""
    everyone = [steps]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, steps)
    return [sorted(i for rank in everyone for i in rank[k]) for k in range(max(map(len, everyone)))]


def _one_process_steps(n, global_bs):
    """A plain single-process loop over the whole stream with batch `W * bs`: the reference."""
    ids = list(range(n))
    return [ids[k : k + global_bs] for k in range(0, n, global_bs)]


# ---- item 2: a stream that splits itself ------------------------------------------------------


def _worker_split_steps(n, bs, workers):
    _allow_loader_workers()
    return _gathered(_ids_by_step(_stream(SplitsByWorker(n), bs, workers)))


@pytest.mark.parametrize("workers", [2, 3])
def test_a_stream_split_by_dataloader_worker_is_exact_on_one_process(workers):
    """Used to train on 1/workers of a batch's blocks: 52 of 101 items with 2 workers."""
    assert _worker_split_steps(101, 8, workers) == _one_process_steps(101, 8)


def test_a_stream_split_by_dataloader_worker_is_exact_on_two_processes(pool2):
    """Used to train on 26 of 101 items (1/W x 1/workers), no warning."""
    for got in pool2.run(_worker_split_steps, 101, 8, 2):
        assert got == _one_process_steps(101, 16)  # global step k = one process's batch k


def _rank_split(n, bs, workers, context):
    _allow_loader_workers()
    sdl = _stream(SplitsByRank(n), bs, workers, context=context)
    steps = []
    try:
        for k, (_, y) in enumerate(sdl):
            steps.append(y[: sdl.real_rows(k)].tolist())
    except ValueError as exc:
        return steps, str(exc)
    return _gathered(steps), None


def test_a_stream_split_by_rank_is_exact_on_one_process():
    assert _gathered(_ids_by_step(_stream(SplitsByRank(64), 8))) == _one_process_steps(64, 8)


@pytest.mark.parametrize("workers,context", [(0, None), (2, "fork")])
def test_a_stream_split_by_rank_is_refused_before_any_step_on_two_processes(pool2, workers, context):
    """Used to train 128 of 512 items an epoch (each rank read 256 and kept every other), silently.
    (Forked workers inherit the process group, so the dataset splits there too.)"""
    for steps, message in pool2.run(_rank_split, 512, 8, workers, context):
        assert steps == [], message  # refused at step 0, on every rank
        assert message is not None and "differs across ranks" in message
        assert "shard(rank, world_size)" in message  # names the fix


def test_a_stream_split_by_rank_outside_the_group_is_read_whole_and_exact(pool2):
    """Workers started by forkserver have no process group: the dataset yields all its items there,
    which is the generic path's premise, so nothing is refused and the split is exact."""
    for steps, message in pool2.run(_rank_split, 64, 8, 2, "forkserver"):
        assert message is None and steps == _one_process_steps(64, 16)


def _learner(train, bs, **kwargs):
    set_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 512))
    dls = DataLoaders(DataLoader(train, batch_size=bs), None)
    return Learner(dls, model, nn.CrossEntropyLoss(), lr=0.1, **kwargs)


def _fit_rank_split():
    learn = _learner(SplitsByRank(512), 8)
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    try:
        with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
            learn.fit(1)
    except ValueError as exc:
        after = learn.raw_model.state_dict()
        return str(exc), all(torch.equal(before[k], after[k]) for k in before)
    return None, False


def test_fit_on_a_stream_split_by_rank_is_refused_before_the_first_step(pool2):
    for message, untouched in pool2.run(_fit_rank_split):
        assert message is not None and "shard(rank, world_size)" in message
        assert untouched  # no optimizer step was taken


def _shard_ignoring_workers(n, bs, workers):
    _allow_loader_workers()
    sdl = _stream(ShardIgnoringWorkers(n), bs, workers)
    ids = []
    try:
        for k, (_, y) in enumerate(sdl):
            ids += y[: sdl.real_rows(k)].tolist()
    except ValueError as exc:
        return ids, str(exc)
    return ids, None


def test_a_self_sharded_stream_whose_parts_miss_len_is_refused(pool2):
    """A `shard()` part not split among 2 workers: every item twice (128 of len() 64), silently."""
    results = pool2.run(_shard_ignoring_workers, 64, 4, 2)
    assert sorted(i for ids, _ in results for i in ids) == sorted(list(range(64)) * 2)  # what was read
    for _, message in results:
        assert message is not None and "128 items" in message and "len(dataset) is 64" in message
    exact = pool2.run(_shard_ignoring_workers, 64, 4, 0)  # no workers: each item once, accepted
    assert sorted(i for ids, _ in exact for i in ids) == list(range(64))
    assert [m for _, m in exact] == [None, None]


# ---- item 3: a Hugging Face stream ----------------------------------------------------------


def _hf_rows(n):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long()
    return {"x": x.tolist(), "labels": y.tolist(), "id": list(range(n))}


def _hf_stream(n, shards):
    data = datasets.Dataset.from_dict(_hf_rows(n))
    return data.to_iterable_dataset(num_shards=shards).with_format("torch")


def _hf_steps(n, shards, bs, workers=0, split="exact"):
    _allow_loader_workers()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sdl = _stream(_hf_stream(n, shards), bs, workers, split=split)
        steps = _ids_by_step(sdl, key="id")
    return _gathered(steps), sdl.generic, err.getvalue()


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_a_hf_stream_is_exact_on_one_process(shards):
    got, _, _ = _hf_steps(50, shards, 8, workers=2)
    assert got == _one_process_steps(50, 8)


def test_a_hf_stream_with_shards_divisible_by_w_is_exact_by_default_on_two_processes(pool2):
    """4 shards on 2 ranks used to go to `split_dataset_by_node`: global step k was not batch k."""
    for workers in (0, 2):
        for got, generic, _ in pool2.run(_hf_steps, 50, 4, 8, workers):
            assert generic
            assert got == _one_process_steps(50, 16)


def test_a_hf_stream_read_by_node_is_an_opt_in_that_says_so(pool2):
    results = pool2.run(_hf_steps, 48, 4, 8, 0, "by_node")
    for got, generic, _ in results:
        assert not generic
        assert sorted(i for step in got for i in step) == list(range(48))  # each item once
        assert got != _one_process_steps(48, 16)  # another order: why it is an opt-in
    logs = [log for _, _, log in results]
    assert 'stream_split="by_node"' in logs[0] and "not the order of one process" in logs[0]
    assert logs[1] == ""  # rank 0 says it, once


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):  # a dict batch: `x` in, `labels` to the loss, `id` left out
        return self.body(x)


def _hf_learner(bs, stream_split="exact"):
    set_seed(0)
    dls = DataLoaders(DataLoader(_hf_stream(48, 4), batch_size=bs), None)
    opt = lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)  # noqa: E731
    return Learner(dls, Net(), nn.CrossEntropyLoss(), opt_func=opt, lr=0.1, stream_split=stream_split)


def _hf_parity(stream_split):
    world = dist.get_world_size()
    single = _hf_learner(8 * world)
    multi = _hf_learner(8, stream_split)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        single.fit(2)
        with multi.distrib_ctx():
            multi.fit(2)
    a, b = single.raw_model.state_dict(), multi.raw_model.state_dict()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_hf_stream_trains_as_one_process_by_default_on_two_processes(pool2):
    """Weights were 1e-2 apart (4 shards, split by node); now they are one process's."""
    for diff in pool2.run(_hf_parity, "exact"):
        assert diff < 1e-5
    for diff in pool2.run(_hf_parity, "by_node"):  # the opt-in reads another order: other weights
        assert diff > 1e-4


def test_stream_split_is_checked():
    with pytest.raises(ValueError, match=r'stream_split must be "exact" or "by_node"'):
        _learner(SplitsByRank(8), 4, stream_split="node")

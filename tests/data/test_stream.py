"""Streams (`IterableDataset`s) sharded across ranks and workers: every item once, every rank in step."""

import contextlib
import io
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.data.stream import RankStream, StreamDL
from unison.distributed.collective import Collective


class Counting(IterableDataset):
    """A generator over `n` items `(id, id)`, the whole stream in every process; no `len()`."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i)


class SelfSharding(Counting):
    """Reads only its part: items `rank, rank + W, ...`, split among workers by itself."""

    def __init__(self, n, rank=0, world_size=1):
        super().__init__(n)
        self.rank, self.world_size = rank, world_size
        self.read = 0

    def shard(self, rank, world_size):
        return SelfSharding(self.n, rank, world_size)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        mine = range(self.rank, self.n, self.world_size)
        for k, i in enumerate(mine):
            if k % workers == worker:
                yield torch.tensor([float(i)]), torch.tensor(i)


class Sized(Counting):
    def __len__(self):
        return self.n


def _real_ids(sdl):
    """The stream ids of this rank's real rows, and its number of steps."""
    ids, steps = [], 0
    for k, (_, y) in enumerate(sdl):
        ids += y[: sdl.real_rows(k)].tolist()
        steps += 1
    return ids, steps


def test_rank_stream_keeps_its_stride():
    assert list(RankStream(range(10), rank=1, world_size=3)) == [1, 4, 7]
    assert list(RankStream(range(10), rank=0, world_size=2, block=2, skip=2)) == [4, 6, 8]


@pytest.mark.parametrize("workers", [0, 2])
def test_simulated_ranks_hold_the_stream_once_in_stream_order(workers):
    world, n, bs = 3, 50, 4
    shares = [
        _real_ids(StreamDL(DataLoader(Counting(n), batch_size=bs, num_workers=workers), r, world))[0]
        for r in range(world)
    ]
    for r, ids in enumerate(shares):
        assert ids == list(range(r, n, world))  # rank r's stride, in stream order, with workers too


def test_one_process_stream_without_len_trains():
    """Used to fail with `TypeError: object of type ... has no len()`."""
    learn = _learner(Counting(20), None, bs=4)
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit(1)
    assert learn.iter == 4  # 5 steps, no length needed


def test_one_cycle_on_a_stream_without_length_is_refused_at_fit_start():
    learn = _learner(Counting(20), None, bs=4)
    before = _weights(learn)
    with pytest.raises(ValueError, match=r"steps_per_epoch"):
        learn.fit_one_cycle(1)
    assert all(torch.equal(before[k], v) for k, v in _weights(learn).items())
    sized = _learner(Sized(20), None, bs=4)
    assert len(sized._shard(sized.dls.train, pad=False)) == 5
    bounded = _learner(Counting(20), None, bs=4, steps_per_epoch=3)
    with contextlib.redirect_stdout(io.StringIO()):
        bounded.fit_one_cycle(1)
    assert bounded.iter == 2 and bounded.n_iter == 3  # the epoch stops at steps_per_epoch


def test_lr_find_on_a_stream_without_length_sweeps_as_on_the_same_rows_in_a_list():
    """Used to fail with `TypeError: object of type ... has no len()`; 6 steps an epoch, 15 asked."""
    x, y = _data(24)
    valid = Table(*_data(8, seed=2))  # never run by the sweep; it sets the model's shape here
    streamed = _learner(Table(x, y), valid, bs=4)
    listed = _learner(list(zip(x, y, strict=True)), valid, bs=4)
    with contextlib.redirect_stdout(io.StringIO()):
        lr = streamed.lr_find(num_it=15)
        expected = listed.lr_find(num_it=15)
    assert len(streamed.lr_finder.losses) == 15  # across 3 passes over the stream
    assert streamed.lr_finder.losses == listed.lr_finder.losses
    assert lr == expected


# ---- real ranks ---------------------------------------------------------------------


def _allow_loader_workers():
    """The pool's ranks are daemon processes, which may not start DataLoader workers; a rank of a
    real launch is not one. (The loader joins its own workers, which is all the flag guards.)"""
    multiprocessing.current_process()._config["daemon"] = False


def _union(n, bs, workers, self_sharding):
    _allow_loader_workers()
    dataset = SelfSharding(n) if self_sharding else Counting(n)
    dl = DataLoader(dataset, batch_size=bs, num_workers=workers)
    sdl = StreamDL(dl, dist.get_rank(), dist.get_world_size(), Collective(dist.group.WORLD))
    ids, steps = _real_ids(sdl)
    return ids, steps, sdl.generic


@pytest.mark.parametrize("self_sharding", [False, True])
def test_every_item_once_and_every_rank_in_step_on_3_ranks(pool3, self_sharding):
    # 49 items, global batch 24: the last step has one item, on rank 0 only.
    results = pool3.run(_union, 49, 8, 0, self_sharding)
    ids = sorted(i for r in results for i in r[0])
    assert ids == list(range(49))
    assert {r[1] for r in results} == {3}
    assert {r[2] for r in results} == {not self_sharding}


def _union_with_workers():
    return [_union(101, 8, 2, self_sharding) for self_sharding in (False, True)]


def test_every_item_once_with_2_loader_workers_on_2_ranks(pool2):
    results = pool2.run(_union_with_workers)
    for way in (0, 1):
        assert sorted(i for r in results for i in r[way][0]) == list(range(101))
        assert results[0][way][1] == results[1][way][1]  # in step
    # Generic: workers split by whole batches, so the rank's batches are full ones as without workers.
    # A self-sharding dataset splits by item among its workers: each worker ends on a partial batch.
    assert results[0][0][1] == 7 and results[0][1][1] == 8


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


class Table(IterableDataset):
    """A generator over rows of a table: what a stream over files looks like."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]


def _learner(train, valid, bs, opt="sgd", steps_per_epoch=None, valid_bs=16):
    set_seed(0)
    opt_func = {
        "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    }[opt]
    # A table has 6 features and 2 classes; a Counting stream has 1 feature and its ids as classes.
    features, classes = (6, 2) if valid is not None else (1, 32)
    model = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))
    dls = DataLoaders(
        DataLoader(train, batch_size=bs),
        DataLoader(valid, batch_size=valid_bs) if valid is not None else None,
    )
    loss = nn.CrossEntropyLoss()
    return Learner(
        dls, model, loss, opt_func=opt_func, lr=0.05, metrics=[accuracy], steps_per_epoch=steps_per_epoch
    )


def _weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


def _parity(opt, workers):
    _allow_loader_workers()
    world = dist.get_world_size()
    x, y = _data(48)
    vx, vy = _data(101, seed=2)
    single = _learner(Table(x, y), Table(vx, vy), bs=8 * world, opt=opt)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
        expected = single.validate()
        preds_1, _ = single.get_preds()
    multi = _learner(Table(x, y), Table(vx, vy), bs=8, opt=opt)
    multi.dls.train.num_workers = workers
    with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx():
        multi.fit(2)
        got = multi.validate()
        preds_w, targets_w = multi.get_preds()
    a, b = _weights(single), _weights(multi)
    return {
        "weights": max(float((a[k] - b[k]).abs().max()) for k in a),
        "valid": max(abs(p - q) for p, q in zip(expected, got, strict=True)),
        "preds": float((preds_1 - preds_w).abs().max()),
        "targets_in_order": bool(torch.equal(targets_w, vy)),
    }


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_stream_parity_and_exact_validation_2_ranks(pool2, opt):
    for r in pool2.run(_parity, opt, 0):
        assert r["weights"] < 1e-5 and r["valid"] < 1e-6 and r["preds"] < 1e-6 and r["targets_in_order"]


def test_stream_parity_and_exact_validation_3_ranks(pool3):
    for r in pool3.run(_parity, "sgd", 0):
        assert r["weights"] < 1e-5 and r["valid"] < 1e-6 and r["preds"] < 1e-6 and r["targets_in_order"]

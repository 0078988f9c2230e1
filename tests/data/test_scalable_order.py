"""DistributedDL with the constant-memory order: W processes take exactly one process's batches,
every item once, padding as the SPEC says, and a resumed step computed from its number alone."""

import contextlib
import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from unison.data import DistributedDL, permutation
from unison.data.permutation import ScalableRandomSampler
from unison.rng import mix_seed as _mix

N, BS, SEED = 103, 4, 11  # 103 items: the last global batch of 2 ranks is short and uneven


def _loader(n=N, bs=BS):
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, shuffle=True)


def _plain_batches(epoch, n=N, bs=BS):
    """One process, batch W*bs, with a plain torch DataLoader over the constant-memory sampler
    whose generator holds the epoch's data seed."""
    g = torch.Generator().manual_seed(_mix(SEED, epoch))
    ds = TensorDataset(torch.arange(n))
    dl = DataLoader(ds, batch_size=bs, sampler=ScalableRandomSampler(ds, generator=g))
    return [b[0].tolist() for b in dl]


def _rank_epochs(pad, start=0):
    """On each rank of the pool: epochs 0 and 1 of its share (epoch 1 from batch `start`)."""
    ddl = DistributedDL(_loader(), seed=SEED, pad=pad, order="scalable")
    out = []
    for epoch in (0, 1):
        ddl.set_epoch(epoch)
        ddl.set_start(start if epoch == 1 else 0)
        batches = [b[0].tolist() for b in ddl]
        out.append({"batches": batches, "real": [ddl.real_rows(k) for k in range(len(ddl))]})
    return out


def _interleave(shares):
    """The global batch the ranks' shares make: rank r holds positions r, r+W, ... of it."""
    merged = [None] * sum(len(s) for s in shares)
    for r, share in enumerate(shares):
        merged[r :: len(shares)] = share
    return merged


def test_two_processes_take_one_processes_batches(pool2):
    ranks = pool2.run(_rank_epochs, False)
    for epoch in (0, 1):
        expected = _plain_batches(epoch, bs=2 * BS)
        per_rank = [r[epoch] for r in ranks]
        n_steps = len(per_rank[0]["batches"])
        assert n_steps == len(per_rank[1]["batches"]) == len(expected) == math.ceil(N / 8)
        for k in range(n_steps):
            shares = [p["batches"][k][: p["real"][k]] for p in per_rank]
            assert _interleave(shares) == expected[k]
        seen = [i for p in per_rank for b, r in zip(p["batches"], p["real"], strict=True) for i in b[:r]]
        assert sorted(seen) == list(range(N))  # every item once, padding never counted
    assert _plain_batches(0) != _plain_batches(1)  # the epoch changes the order


def test_one_process_is_the_plain_loop():
    ddl = DistributedDL(_loader(), 0, 1, seed=SEED, order="scalable")
    for epoch in (0, 3):
        ddl.set_epoch(epoch)
        assert [b[0].tolist() for b in ddl] == _plain_batches(epoch)


@pytest.mark.parametrize(("n", "world", "bs"), [(103, 4, 4), (10, 3, 4), (2, 3, 1), (64, 2, 8)])
def test_padding_wraps_the_global_order(n, world, bs):
    """pad=True: each rank ceil(n/W) items, positions r, r+W, ... of the order wrapped past its end."""
    order = sum(_plain_batches(0, n=n, bs=n), [])
    g = torch.Generator().manual_seed(_mix(SEED, 0))
    assert order == list(ScalableRandomSampler(range(n), generator=g))
    real_seen = []
    for rank in range(world):
        ddl = DistributedDL(_loader(n, bs), rank, world, seed=SEED, order="scalable")
        items = sum((b[0].tolist() for b in ddl), [])
        per_rank = math.ceil(n / world)
        assert items == [order[(rank + world * j) % n] for j in range(per_rank)]
        assert ddl.n_items == per_rank and sum(ddl.real_rows(k) for k in range(len(ddl))) == ddl.n_real
        real_seen += items[: ddl.n_real]
    assert sorted(real_seen) == list(range(n))


def test_resume_mid_epoch_from_the_step_number(pool2):
    whole = pool2.run(_rank_epochs, False)
    resumed = pool2.run(_rank_epochs, False, 5)
    for full, part in zip(whole, resumed, strict=True):
        assert part[1]["batches"] == full[1]["batches"][5:]
        assert part[0] == full[0]


def test_a_resumed_step_of_a_huge_epoch_costs_what_the_first_does():
    """10^10 items: no order is drawn; step 4*10^6 of rank 3 of 8 is evaluated directly."""
    n, world, bs, step = 10**10, 8, 256, 4 * 10**6
    dl = DataLoader(range(n), batch_size=bs, shuffle=True)
    ddl = DistributedDL(dl, 3, world, seed=SEED, pad=False)  # auto: over 1 GiB as a tensor
    assert ddl.order == "scalable" and len(ddl) == math.ceil(n / (world * bs))
    ddl.set_start(step)
    got = next(iter(ddl)).tolist()
    order = permutation.PermutedOrder(n, permutation.draw_key(torch.Generator().manual_seed(_mix(SEED, 0))))
    positions = [3 + world * (step * bs + i) for i in range(bs)]
    assert got == [order[p] for p in positions]


def test_auto_switches_past_the_memory_share_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(permutation, "ORDER_MEMORY_BYTES", 8 * N - 1)
    ddl = DistributedDL(_loader(), 0, 1, seed=SEED)
    assert ddl.order == "scalable" and [b[0].tolist() for b in ddl] == _plain_batches(0)
    assert capsys.readouterr().err.count("constant-memory") == 1
    DistributedDL(_loader(), 1, 2, seed=SEED)
    assert capsys.readouterr().err == ""  # rank 0 only
    torch_order = DistributedDL(_loader(), 0, 1, seed=SEED, order="torch")
    g = torch.Generator().manual_seed(_mix(SEED, 0))
    ds = TensorDataset(torch.arange(N))
    plain = DataLoader(ds, batch_size=BS, sampler=RandomSampler(ds, generator=g))
    assert [b[0].tolist() for b in torch_order] == [b[0].tolist() for b in plain]  # torch's, bit for bit


def test_scalable_refuses_a_weighted_sampler():
    weights = torch.ones(10)
    dl = DataLoader(range(10), batch_size=2, sampler=torch.utils.data.WeightedRandomSampler(weights, 10))
    with pytest.raises(ValueError, match='order="scalable" shuffles every item once.*WeightedRandomSampler'):
        DistributedDL(dl, 0, 2, seed=0, order="scalable")


def _train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g)  # 60 items, global batch 8: the last step has 4
    return TensorDataset(x, (x[:, 0] - x[:, 1] > 0).long())


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))


OPTS = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
}


def _fit_on_ranks(opt):
    """A Learner on every rank of the pool, its train loader shuffled by ScalableRandomSampler."""
    from unison import DataLoaders, Learner

    ds = _train_data()
    dls = DataLoaders(DataLoader(ds, batch_size=4, sampler=ScalableRandomSampler(ds)), None)
    learn = Learner(dls, _model(), nn.CrossEntropyLoss(), opt_func=OPTS[opt], lr=0.05)
    learn.data_seed = SEED
    learn.recorder.print_table = False
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        learn.fit(2)
    return {k: v.clone() for k, v in learn.raw_model.state_dict().items()}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_training_on_two_processes_ends_on_the_plain_loops_weights(pool2, opt):
    """2 ranks x batch 4 in the constant-memory order = one process, batch 8, the same order."""
    ds = _train_data()
    model = _model()
    optimizer = OPTS[opt](model.parameters(), 0.05)
    for epoch in range(2):
        g = torch.Generator().manual_seed(_mix(SEED, epoch))
        for xb, yb in DataLoader(ds, batch_size=8, sampler=ScalableRandomSampler(ds, generator=g)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    expected = model.state_dict()
    for weights in pool2.run(_fit_on_ranks, opt):
        for name, value in weights.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


class _Crash(Exception):
    """Stands for a crash mid-epoch (not a cancel exception: fit ends at once)."""


def _checkpointed_learner(path, init_seed=0):
    from unison import Checkpoint, DataLoaders, Learner

    ds = _train_data()
    dls = DataLoaders(DataLoader(ds, batch_size=8, sampler=ScalableRandomSampler(ds)), None)
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    learn = Learner(dls, model, nn.CrossEntropyLoss(), lr=0.05, path=path, cbs=[Checkpoint(every=1)])
    learn.data_seed = SEED
    learn.recorder.print_table = False
    return learn


def test_a_learner_stopped_mid_epoch_resumes_on_the_uninterrupted_weights(tmp_path):
    from unison import Callback

    class CrashAt(Callback):
        order = 95  # after Checkpoint wrote this batch's state

        def __init__(self, at):
            self.at, self.count = at, 0

        def after_batch(self):
            self.count += self.learn.training
            if self.count == self.at:
                raise _Crash()

    reference = _checkpointed_learner(tmp_path / "ref")
    with contextlib.redirect_stdout(io.StringIO()):
        reference.fit(2)
    assert reference._shard(reference.dls.train, pad=False).order == "scalable"
    expected = reference.raw_model.state_dict()
    for at in (3, 8, 11):  # 8 steps an epoch: mid first epoch, first step of the second, mid second
        first = _checkpointed_learner(tmp_path / f"at{at}")
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(_Crash):
            first.fit(2, cbs=[CrashAt(at)])
        resumed = _checkpointed_learner(tmp_path / f"at{at}", init_seed=99)
        resumed.data_seed = 5  # the checkpoint restores the seed of the order
        with contextlib.redirect_stdout(io.StringIO()):
            resumed.fit(2, resume=True)
        got = resumed.raw_model.state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected), at

"""A length-bucketing batch_sampler on W processes: global step k uses one process's batch k."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from unison import DataLoaders, Learner, accuracy, set_seed


class Bucketing(Sampler):
    """Shuffled, then sorted by length within pools of 4 batches; batches in random order, the last
    one short. Draws from the global RNG (as most samplers do)."""

    def __init__(self, lengths, bs):
        self.lengths, self.bs = lengths, bs

    def __len__(self):
        return -(-len(self.lengths) // self.bs)

    def __iter__(self):
        perm = torch.randperm(len(self.lengths)).tolist()
        pool = 4 * self.bs
        batches = []
        for start in range(0, len(perm), pool):
            chunk = sorted(perm[start : start + pool], key=lambda i: self.lengths[i])
            batches += [chunk[k : k + self.bs] for k in range(0, len(chunk), self.bs)]
        order = torch.randperm(len(batches)).tolist()
        return iter([batches[k] for k in order])


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    lengths = torch.randint(1, 50, (n,), generator=g).tolist()
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()), lengths


def _learner(opt):
    set_seed(0)
    train, lengths = _data(50, 1)  # batches of 6: the last has 2 items, fewer than 3 ranks
    valid, vlengths = _data(31, 2)
    dls = DataLoaders(
        DataLoader(train, batch_sampler=Bucketing(lengths, 6)),
        DataLoader(valid, batch_sampler=Bucketing(vlengths, 8)),
    )
    opt_func = {
        "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    }[opt]
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    return Learner(dls, model, nn.CrossEntropyLoss(), opt_func=opt_func, lr=0.05, metrics=[accuracy])


def _parity(opt):
    single = _learner(opt)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
        expected = single.validate()
        preds_1, targets_1 = single.get_preds()
    multi = _learner(opt)
    with contextlib.redirect_stdout(io.StringIO()), multi.distrib_ctx():
        multi.fit(2)
        got = multi.validate()
        preds_w, targets_w = multi.get_preds()
    a, b = single.raw_model.state_dict(), multi.raw_model.state_dict()
    return {
        "weights": max(float((a[k] - b[k]).abs().max()) for k in a),
        "valid": max(abs(p - q) for p, q in zip(expected, got, strict=True)),
        # In the loader's order (its batches joined), each item once.
        "preds": float((preds_1 - preds_w).abs().max()) if preds_1.shape == preds_w.shape else 1.0,
        "targets": bool(torch.equal(targets_1, targets_w)) and len(targets_w) == 31,
    }


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bucketing_batch_sampler_parity_2_ranks(pool2, opt):
    for r in pool2.run(_parity, opt):
        assert r["weights"] < 1e-5 and r["valid"] < 1e-6 and r["preds"] < 1e-6 and r["targets"]


def test_bucketing_batch_sampler_parity_3_ranks(pool3):
    for r in pool3.run(_parity, "sgd"):
        assert r["weights"] < 1e-5 and r["valid"] < 1e-6 and r["preds"] < 1e-6 and r["targets"]


def _refused_at_entry(which):
    set_seed(0)
    train, _ = _data(16, 1)
    good = DataLoader(train, batch_size=4)
    bad = DataLoader(train, batch_size=4, sampler=DistributedSampler(train))
    dls = DataLoaders(bad, good) if which == "train" else DataLoaders(good, bad)
    learn = Learner(dls, nn.Linear(6, 2), nn.CrossEntropyLoss())
    try:
        with learn.distrib_ctx():
            return "entered"
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("which", ["train", "valid"])
def test_an_unshardable_loader_is_refused_at_distrib_ctx_entry(pool2, which):
    for message in pool2.run(_refused_at_entry, which):
        assert f"the {which} loader (dls.{which}) cannot be sharded" in message
        assert "DistributedSampler" in message and "give it a plain sampler" in message
    assert not dist.is_initialized()  # (in this process; the pool's group is untouched)


def _stop_and_resume(path, distributed, stops):
    from tests.checkpoint.test_callback import Stop, StopAt
    from unison import Checkpoint

    ctx = (lambda learn: learn.distrib_ctx()) if distributed else (lambda learn: contextlib.nullcontext())

    def fit(learn, cbs=(), resume=False):
        with contextlib.redirect_stdout(io.StringIO()):
            learn.fit_one_cycle(2, lr_max=1e-2, cbs=cbs, resume=resume)

    def learner(run_dir, seed=0):
        learn = _learner("adamw")
        learn.path = run_dir
        learn.add_cb(Checkpoint(every=1))
        if seed:
            set_seed(seed)
            other = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
            learn.raw_model.load_state_dict(other.state_dict())
        return learn

    reference = learner(path / "ref")
    with ctx(reference):
        fit(reference)
    same = []
    for at in stops:
        first = learner(path / f"stop{at}")
        with ctx(first), pytest.raises(Stop):
            fit(first, cbs=[StopAt(at)])
        resumed = learner(path / f"stop{at}", seed=99)  # other weights: the checkpoint restores them
        with ctx(resumed):
            fit(resumed, resume=True)
        a, b = reference.raw_model.state_dict(), resumed.raw_model.state_dict()
        same.append(all(torch.equal(a[k], b[k]) for k in a))
    return same


def test_bucketing_batch_sampler_resumes_exactly_one_process(tmp_path):
    assert _stop_and_resume(tmp_path, False, [3, 9, 12]) == [True] * 3  # 9 steps an epoch


def test_bucketing_batch_sampler_resumes_exactly_two_processes(pool2, tmp_path):
    for same in pool2.run(_stop_and_resume, tmp_path, True, [3, 12]):
        assert same == [True, True]

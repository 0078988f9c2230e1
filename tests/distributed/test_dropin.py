"""Seed-style scripts on real gloo groups: `to_distributed(local_rank)` on CPU, rank-0-only `save`,
one metric given alone, and datasets that differ across ranks."""

import contextlib
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, accuracy, set_seed
from unison.distributed import local_rank


def _data(n=48, features=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 32, features, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def _learner(bs, path=".", metrics=accuracy, data=None):
    set_seed(0)
    train, valid = data or _data()
    dls = DataLoaders(DataLoader(train, batch_size=bs, shuffle=True), DataLoader(valid, batch_size=16))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    return Learner(dls, model, nn.CrossEntropyLoss(), opt_func=sgd, lr=0.1, metrics=metrics, path=path)


def _flat(learn):
    return torch.cat([v.detach().flatten() for v in learn.raw_model.state_dict().values()])


# ---- item 3: one metric, fastai's style ------------------------------------------------------------
def test_a_single_metric_is_accepted_and_equals_the_list_form():
    one, many = _learner(16, metrics=accuracy), _learner(16, metrics=[accuracy])
    with contextlib.redirect_stdout(io.StringIO()):
        one.fit(1)
        many.fit(1)
    got, expected = one.validate(), many.validate()
    assert len(got) == 2 and got == expected
    x, y = _data()[1].tensors
    assert got[1] == pytest.approx(float((one.model(x).argmax(-1) == y).float().mean()))


# ---- item 1: a script's own `to_distributed(local_rank)` on a CPU machine ----------------------------------
def _to_distributed_with_local_rank():
    single = _learner(16)
    with contextlib.redirect_stdout(io.StringIO()):
        single.fit(2)
    # the group is the pool's own (as in examples/local_rank.py)
    learn = _learner(8).to_distributed(local_rank())
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit(2)
    device = str(learn.device)
    learn.detach_distributed()
    return device, float((_flat(learn) - _flat(single)).abs().max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: a cuda_id names no GPU here")
def test_to_distributed_with_a_cuda_id_trains_on_cpu_without_cuda(pool2):
    for device, diff in pool2.run(_to_distributed_with_local_rank):
        assert device == "cpu"
        assert diff < 1e-5  # and it is real data-parallel training: 2 x 8 equals 1 x 16


# ---- item 2: save() outside distrib_ctx is written by rank 0 only ---------------------------------------
def _save_outside_ctx(tmp_path):
    learn = _learner(8, path=tmp_path / f"rank{dist.get_rank()}")
    with contextlib.redirect_stdout(io.StringIO()), learn.distrib_ctx():
        learn.fit(1)
    learn.save("after")  # the README's own pattern: save after leaving the context
    dist.barrier()  # (outside distrib_ctx save() waits for nobody: a rank may call it alone)
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pth"))


def test_save_after_distrib_ctx_is_written_by_rank0_only(pool2, tmp_path):
    r0, r1 = pool2.run(_save_outside_ctx, tmp_path)
    assert r0 == r1 == ["rank0/models/after.pth"]


def test_save_under_a_launcher_without_a_group_is_left_to_rank0(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    learn = _learner(8, path=tmp_path)
    assert learn.save("m") == tmp_path / "models" / "m.pth"
    assert not (tmp_path / "models" / "m.pth").exists()
    monkeypatch.setenv("RANK", "0")
    assert learn.save("m").exists()


# ---- item 10: ranks that built different data ----------------------------------------------------------
class _Augmented(torch.utils.data.Dataset):
    """The same stored items on every rank, with a random augmentation drawn in __getitem__."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


def _data_checks():
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)  # random data made without a common seed
    x = torch.randn(48, 6, generator=g)
    own = TensorDataset(x, (x[:, 0] > 0).long())
    results = {}
    learn = _learner(8, data=(own, own))
    try:
        with learn.distrib_ctx():
            results["unseeded"] = "no error"
    except ValueError as exc:
        results["unseeded"] = str(exc)
    results["left_unwrapped"] = type(learn.model).__name__
    with learn.distrib_ctx(check_data=False):  # the opt-out, for data meant to differ
        results["opt_out_wrapped"] = type(learn.model).__name__
    train, valid = _data()
    torch.manual_seed(rank)  # per-rank RNG state: augmentations differ, the stored data does not
    aug = _learner(8, data=(_Augmented(*train.tensors), valid))
    torch.manual_seed(rank)
    before = torch.rand(1)
    torch.manual_seed(rank)
    with aug.distrib_ctx():
        results["augmented_rng_untouched"] = bool(torch.equal(torch.rand(1), before))
    return results


def test_ranks_holding_different_items_are_refused_by_name(pool2):
    for r in pool2.run(_data_checks):
        assert r["unseeded"].startswith("the train dataset differs across ranks: rank(s) [1] hold other")
        assert "same length 48" in r["unseeded"] and "check_data=False" in r["unseeded"]
        assert r["left_unwrapped"] == "Sequential" and r["opt_out_wrapped"] == "DistributedDataParallel"
        assert r["augmented_rng_untouched"]  # no false alarm from augmentation, no RNG drawn


# ---- item 9: --timeout / distrib_ctx(timeout=) reach a group the script made ----------------------------
def _group_timeout():
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _timeout_applied():
    import datetime

    import torch.distributed.distributed_c10d as c10d

    seen = {"made_by_the_pool": _group_timeout()}
    learn = _learner(8)
    with learn.distrib_ctx():  # nothing asked for: the script's own timeout is kept
        seen["nothing_asked"] = _group_timeout()
    with learn.distrib_ctx(timeout=7):
        seen["distrib_ctx"] = _group_timeout()
    os.environ["UNISON_TIMEOUT"] = "9"  # what `unison launch --timeout 9` exports
    try:
        learn.to_distributed(local_rank())
        seen["launch_timeout"] = _group_timeout()
        learn.detach_distributed()
    finally:
        del os.environ["UNISON_TIMEOUT"]
        c10d._set_pg_timeout(datetime.timedelta(seconds=seen["made_by_the_pool"]))  # the pool's again
    return seen


def test_a_timeout_asked_for_bounds_a_group_the_script_made(pool2):
    for seen in pool2.run(_timeout_applied):
        assert seen == {"made_by_the_pool": 60, "nothing_asked": 60, "distrib_ctx": 7, "launch_timeout": 9}

"""Unshuffled loaders (torch's `SequentialSampler`) in constant memory: a rank computes its positions
r, r+W, ... of the identity order on demand, W ranks take one process's batches, and a resumed step
is computed from its number alone, at 10^10 items as at 103."""

import contextlib
import math
import resource

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from unison.data import DistributedDL
from unison.data.permutation import PermutedOrder

N, BS = 103, 4  # 103 items: the last global batch of 2 or 3 ranks is short and uneven


def _loader(n=N, bs=BS):
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=bs)  # shuffle=False: SequentialSampler


def _plain_batches(n=N, bs=BS):
    """One process, a plain torch DataLoader: what W ranks of batch `bs / W` must make together."""
    return [b[0].tolist() for b in _loader(n, bs)]


def _interleave(shares):
    """The global batch the ranks' shares make: rank r holds positions r, r+W, ... of it."""
    merged = [None] * sum(len(s) for s in shares)
    for r, share in enumerate(shares):
        merged[r :: len(shares)] = share
    return merged


@contextlib.contextmanager
def _address_space_grows_at_most(extra_bytes):
    """Refuse any allocation that takes this process's address space more than `extra_bytes` above
    what it is now (a peak bound, stricter than RSS: an index list of the epoch cannot be made)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * resource.getpagesize()
    cap = now + extra_bytes if hard == resource.RLIM_INFINITY else min(now + extra_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_together_take_one_processes_batches(world):
    """pad=False (how the learner trains): rank shares interleave into the plain loop's batches of
    W x bs, every item once, padding never counted."""
    expected = _plain_batches(bs=world * BS)
    per_rank = []
    for rank in range(world):
        ddl = DistributedDL(_loader(), rank, world, seed=0, pad=False)
        batches = [b[0].tolist() for b in ddl]
        per_rank.append((batches, [ddl.real_rows(k) for k in range(len(ddl))]))
    assert all(len(b) == len(expected) == math.ceil(N / (world * BS)) for b, _ in per_rank)
    for k in range(len(expected)):
        assert _interleave([b[k][: r[k]] for b, r in per_rank]) == expected[k]
    seen = [i for b, r in per_rank for batch, real in zip(b, r, strict=True) for i in batch[:real]]
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize(("n", "world", "bs"), [(103, 4, 4), (10, 3, 4), (2, 3, 1), (64, 2, 8)])
def test_padding_wraps_the_identity_order(n, world, bs):
    """pad=True (evaluation, get_preds): each rank ceil(n/W) items, positions r, r+W, ... wrapped."""
    real_seen = []
    for rank in range(world):
        ddl = DistributedDL(_loader(n, bs), rank, world, seed=0)
        items = sum((b[0].tolist() for b in ddl), [])
        assert items == [(rank + world * j) % n for j in range(math.ceil(n / world))]
        assert sum(ddl.real_rows(k) for k in range(len(ddl))) == ddl.n_real
        real_seen += items[: ddl.n_real]
    assert sorted(real_seen) == list(range(n))


@pytest.mark.parametrize("pad", [False, True])
def test_resume_from_the_step_number(pad):
    for rank in range(2):
        ddl = DistributedDL(_loader(), rank, 2, seed=0, pad=pad)
        whole = [b[0].tolist() for b in ddl]
        whole_real = [ddl.real_rows(k) for k in range(len(ddl))]
        ddl.set_start(5)
        assert [b[0].tolist() for b in ddl] == whole[5:]
        assert [ddl.real_rows(k) for k in range(5, len(ddl))] == whole_real[5:]
        mine = range(rank, N, 2)  # every real item of the rank, once, padding (pad=True) after them
        assert sum(whole, [])[: len(mine)] == list(mine) and sum(whole_real) == len(mine)


def test_the_order_is_the_same_for_every_epoch_seed_and_world_size():
    orders = [
        DistributedDL(_loader(), r, w, seed=s).global_order(e) for r, w, s, e in [(0, 1, 0, 0), (1, 4, 9, 3)]
    ]
    assert [list(o) for o in orders] == [list(range(N))] * 2


def test_ten_billion_unshuffled_items_are_never_listed():
    """10^10 items, rank 3 of 8: the first batch, a batch 4 x 10^6 steps in, and the global order
    (what the learner's cross-rank check hashes) are computed while this process may not grow by
    1 GiB (the epoch's index list would take 80 GB; this rank's share of it 10 GB)."""
    n, world, bs, step = 10**10, 8, 256, 4 * 10**6
    dl = DataLoader(range(n), batch_size=bs)
    with _address_space_grows_at_most(1 << 30):
        ddl = DistributedDL(dl, 3, world, seed=0, pad=False)
        assert len(ddl) == math.ceil(n / (world * bs))
        first = next(iter(ddl)).tolist()
        ddl.set_start(step)
        resumed = next(iter(ddl)).tolist()
        padded = DistributedDL(DataLoader(range(n + 3), batch_size=bs), 7, world, seed=0)  # pad=True
        padded.set_start(len(padded) - 1)
        last = [b.tolist() for b in padded]  # wraps past the end of the epoch to the start
        order = ddl.global_order(0)
        described = repr(order)
        assert len(order) == n and order[n - 1] == n - 1 and order[12345] == 12345
    assert first == [3 + world * i for i in range(bs)]
    assert resumed == [3 + world * (step * bs + i) for i in range(bs)]
    per_rank = math.ceil((n + 3) / world)
    assert last == [[(7 + world * j) % (n + 3) for j in range((len(padded) - 1) * bs, per_rank)]]
    assert last[0][-1] == 4 and padded.n_real == per_rank - 1
    assert len(described) < 100


def test_the_identity_order_is_a_permuted_order_without_a_key():
    order = PermutedOrder.identity(10**12)
    positions = torch.tensor([0, 5, 10**12 - 1])
    assert order.at(positions).tolist() == positions.tolist() and len(order) == 10**12
    assert order[7] == 7 and order[-1] == 10**12 - 1 and order[3:6] == [3, 4, 5]
    assert list(PermutedOrder.identity(5)) == [0, 1, 2, 3, 4] and "identity" in repr(order)

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)

from unison.data.loader import DistributedDL

N = 50


def _shards(dl, world_size, epoch=0, seed=0):
    """Every rank's items for `epoch`, flattened, by rank."""
    out = []
    for r in range(world_size):
        ddl = DistributedDL(dl, r, world_size, seed=seed)
        ddl.set_epoch(epoch)
        out.append(torch.cat(list(ddl)).tolist())
    return out


@pytest.mark.parametrize("rank", range(4))
def test_first_batch_is_strided_and_wrapped(rank):
    dl = DataLoader(list(range(N)), batch_size=16)
    assert torch.equal(list(DistributedDL(dl, rank, 4))[0], torch.arange(rank, 52, 4) % N)


def test_shuffled_ranks_cover_data_and_order_depends_on_seed_and_epoch():
    dl = DataLoader(list(range(N)), batch_size=16, shuffle=True)
    firsts = [list(DistributedDL(dl, r, 4, seed=7))[0] for r in range(4)]
    assert np.array_equal(np.unique(torch.cat(firsts).numpy()), np.arange(N))
    e0, e1 = _shards(dl, 4, epoch=0, seed=7), _shards(dl, 4, epoch=1, seed=7)
    assert e0 != e1
    assert e0 == _shards(dl, 4, epoch=0, seed=7)
    assert e0 != _shards(dl, 4, epoch=0, seed=8)


def test_iterating_twice_without_set_epoch_reshuffles():
    ddl = DistributedDL(DataLoader(list(range(N)), batch_size=N, shuffle=True), 0, 1, seed=3)
    first, second = next(iter(ddl)), next(iter(ddl))
    assert ddl.epoch == 2 and not torch.equal(first, second)


def test_weighted_sampler_order_is_shared():
    weights = torch.as_tensor(np.arange(N) >= 25, dtype=torch.double)
    dl = DataLoader(list(range(N)), batch_size=8, sampler=WeightedRandomSampler(weights, N))
    shards = _shards(dl, 4, seed=1)
    assert all(min(s) >= 25 for s in shards)
    assert shards == _shards(dl, 4, seed=1)


def test_world_size_1_order_is_the_interleaving_of_ranks():
    dl = DataLoader(list(range(N)), batch_size=4, shuffle=True)
    (single,) = _shards(dl, 1, epoch=2)
    padded = [single[p % N] for p in range(51)]  # 50 padded by wrap to a multiple of 3
    for r, shard in enumerate(_shards(dl, 3, epoch=2)):
        assert shard == padded[r::3]


@pytest.mark.parametrize("drop_last, lengths", [(False, (4, 13)), (True, (3, 12))])
def test_lengths_and_drop_last(drop_last, lengths):
    dl = DataLoader(list(range(N)), batch_size=4, drop_last=drop_last)
    for r in range(4):
        ddl = DistributedDL(dl, r, 4)
        batches = list(ddl)
        assert (len(ddl), ddl.n_items) == lengths == (len(batches), sum(len(b) for b in batches))


@pytest.mark.parametrize("n, world_size, bs", [(11, 2, 2), (50, 4, 4), (23, 3, 2), (5, 2, 4)])
def test_an_evaluation_with_drop_last_drops_what_one_process_drops_at_the_global_batch(n, world_size, bs):
    """One process at batch size W * bs evaluates the whole global batches only; so do W ranks
    (each rank's remainder was dropped instead: 11 items at 2 x 2 were all scored, not 8)."""
    dl = DataLoader(list(range(n)), batch_size=bs, drop_last=True)
    ddls = [DistributedDL(dl, r, world_size) for r in range(world_size)]
    scored = sorted(i for d in ddls for b in d for i in b.tolist())
    assert scored == list(range(n - n % (world_size * bs)))
    assert all(d.n_real == d.n_items and len(d) == n // (world_size * bs) for d in ddls)


def test_n_real_marks_the_padding():
    dl = DataLoader(list(range(N)), batch_size=16)
    ddls = [DistributedDL(dl, r, 4) for r in range(4)]
    assert [d.n_real for d in ddls] == [13, 13, 12, 12]
    assert [d.n_items for d in ddls] == [13] * 4
    # The padded item is rank 2's and 3's last: the wrap-around of positions 50 and 51.
    assert [torch.cat(list(d))[-1].item() for d in ddls[2:]] == [0, 1]


def test_fewer_items_than_ranks_wraps():
    ddls = [DistributedDL(DataLoader([10, 11], batch_size=2), r, 4) for r in range(4)]
    assert [torch.cat(list(d)).tolist() for d in ddls] == [[10], [11], [10], [11]]
    assert [d.n_real for d in ddls] == [1, 1, 0, 0]


def test_empty_dataset():
    ddl = DistributedDL(DataLoader([], batch_size=4), 1, 2)
    assert (len(ddl), list(ddl), ddl.n_items, ddl.n_real) == (0, [], 0, 0)


def test_set_start_skips_batches_once():
    ddl = DistributedDL(DataLoader(list(range(N)), batch_size=4, shuffle=True), 1, 2, seed=5)
    full = list(ddl)
    ddl.set_epoch(0)
    ddl.set_start(3)
    resumed = list(ddl)
    assert len(ddl) == 7 and len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(full[3:], resumed, strict=True))
    ddl.set_epoch(0)
    assert len(list(ddl)) == 7


def test_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    ddl = DistributedDL(DataLoader(list(range(N)), batch_size=8, shuffle=True), 0, 2)
    for _ in range(2):
        list(ddl)
    assert torch.equal(torch.get_rng_state(), before)


def test_collate_fn_is_kept():
    def collate(items):
        return {"x": torch.tensor(items), "n": len(items)}

    batch = next(iter(DistributedDL(DataLoader(list(range(10)), batch_size=3, collate_fn=collate), 0, 2)))
    assert batch["n"] == 3 and batch["x"].tolist() == [0, 2, 4]


class _Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


class _BatchedSquares(_Squares):
    def __init__(self, n):
        super().__init__(n)
        self.calls = []

    def __getitems__(self, idx):
        self.calls.append(list(idx))
        return [self[i] for i in idx]


def test_getitems_gets_whole_batches():
    fast, slow = _BatchedSquares(N), _Squares(N)
    got = [
        list(DistributedDL(DataLoader(ds, batch_size=8, shuffle=True), 1, 2, seed=4)) for ds in (fast, slow)
    ]
    assert len(fast.calls) == len(got[0]) == 4
    assert [len(c) for c in fast.calls] == [8, 8, 8, 1]
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


class _GlobalRandSampler(Sampler):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_user_sampler_on_the_global_rng_is_deterministic():
    dl = DataLoader(list(range(N)), batch_size=N, sampler=_GlobalRandSampler(N))
    torch.manual_seed(0)
    a = next(iter(DistributedDL(dl, 0, 1, seed=9)))
    torch.manual_seed(1)
    b = next(iter(DistributedDL(dl, 0, 1, seed=9)))
    assert torch.equal(a, b) and not torch.equal(a, torch.arange(N))


def test_persistent_workers_across_epochs():
    ds = TensorDataset(torch.arange(20))
    dl = DataLoader(ds, batch_size=5, shuffle=True, num_workers=1, persistent_workers=True)
    ddl = DistributedDL(dl, 0, 2, seed=2)
    epochs = []
    for epoch in range(2):
        ddl.set_epoch(epoch)
        epochs.append(torch.cat([b for (b,) in ddl]).tolist())
    ref = DistributedDL(DataLoader(ds, batch_size=5, shuffle=True), 0, 2, seed=2)
    assert epochs == [torch.cat([b for (b,) in ref]).tolist() for _ in range(2)]
    assert epochs[0] != epochs[1]


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_unsupported_loaders_are_clear_errors():
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        DistributedDL(DataLoader(_Stream(), batch_size=2), 0, 1)
    with pytest.raises(ValueError, match="batch_size=None"):
        DistributedDL(DataLoader(list(range(8)), batch_size=None), 0, 1)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        DistributedDL(DataLoader(list(range(8))), 2, 2)
    with pytest.raises(ValueError, match="rank=0, world_size=0"):
        DistributedDL(DataLoader(list(range(8))), 0, 0)


def _seed_and_shard():
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    ddl = DistributedDL(DataLoader(list(range(N)), batch_size=8, shuffle=True))
    return ddl.seed, (ddl.rank, ddl.world_size), torch.cat(list(ddl)).tolist()


def test_default_seed_is_broadcast(pool2):
    (s0, where0, shard0), (s1, where1, shard1) = pool2.run(_seed_and_shard)
    assert s0 == s1 == 0
    assert (where0, where1) == ((0, 2), (1, 2))
    assert not set(shard0) & set(shard1) and sorted(shard0 + shard1) == list(range(N))


def test_tensor_dataset_is_fetched_a_batch_at_a_time_with_the_same_batches():
    """The fast path: one indexing op per tensor per batch, identical to item-by-item + default_collate."""
    from unison.data.loader import _TensorBatches

    x, y = torch.randn(50, 3), torch.arange(50)
    fast = DistributedDL(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), 1, 3, seed=7)
    assert isinstance(fast._inner.dataset, _TensorBatches)

    class ItemByItem(TensorDataset):  # a subclass: not eligible, goes item by item
        pass

    slow = DistributedDL(DataLoader(ItemByItem(x, y), batch_size=8, shuffle=True), 1, 3, seed=7)
    assert not isinstance(slow._inner.dataset, _TensorBatches)
    for epoch in range(2):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        got, expected = list(fast), list(slow)
        assert len(got) == len(expected) == 3
        for a, b in zip(got, expected, strict=True):
            assert type(a) is type(b) is list
            assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(a, b, strict=True))


def test_the_batch_fetch_gathers_rows_without_starting_cpu_threads_that_then_spin():
    """`t[idx]` (advanced indexing) runs a small batch in parallel (its grain is 3,000 elements) and
    every OpenMP thread then spins ~3.5 ms: on a GPU machine's 16 threads, 100 CPU ms per step (the
    GPU benchmark found it). `index_select` gathers the same rows and parallelises only big ones."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = torch.randint(65, (320, 256)), torch.arange(320)
    dl = DistributedDL(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), 0, 1, seed=3)
    with Ops():
        batches = list(dl)
    assert "aten.index.Tensor" not in seen and seen.count("aten.index_select.default") == 2 * len(batches)
    order = torch.cat([b[1] for b in batches])
    assert torch.equal(torch.cat([b[0] for b in batches]), x[order])


def test_a_custom_collate_keeps_the_item_by_item_path():
    from unison.data.loader import _TensorBatches

    ds = TensorDataset(torch.arange(10.0))
    dl = DistributedDL(DataLoader(ds, batch_size=4, collate_fn=lambda items: len(items)), 0, 1)
    assert not isinstance(dl._inner.dataset, _TensorBatches) and list(dl) == [4, 4, 2]


def test_unpadded_shards_hold_each_item_once_and_split_the_last_global_batch():
    """Training's plan (pad=False): 50 items, batch 4, W=4: 3 full global batches of 16, then 2 items
    split over ranks 0 and 1; ranks 2 and 3 get one padding item each, marked as not real."""
    dl = DataLoader(list(range(50)), batch_size=4, shuffle=True)
    ddls = [DistributedDL(dl, r, 4, seed=3, pad=False) for r in range(4)]
    batches = [list(d) for d in ddls]
    assert [len(d) for d in ddls] == [4] * 4
    real = [
        [b[: d.real_rows(k)].tolist() for k, b in enumerate(bs)] for d, bs in zip(ddls, batches, strict=True)
    ]
    seen = sorted(i for per_rank in real for b in per_rank for i in b)
    assert seen == list(range(50))  # every item once, no wrap-around duplicate
    assert [d.real_rows(3) for d in ddls] == [1, 1, 0, 0]
    assert [len(bs[3]) for bs in batches] == [1, 1, 1, 1]  # an empty share still yields a batch
    assert [ddls[0].global_rows(k) for k in range(4)] == [16, 16, 16, 2]
    # the k-th global batch is one process's k-th batch of 16, in the same order
    single = list(
        DistributedDL(DataLoader(list(range(50)), batch_size=16, shuffle=True), 0, 1, seed=3, pad=False)
    )
    for k in range(4):
        together = sorted(i for per_rank in real for i in per_rank[k])
        assert together == sorted(single[k].tolist())


def test_unpadded_shards_with_drop_last_drop_the_incomplete_global_batch():
    dl = DataLoader(list(range(50)), batch_size=4, drop_last=True)
    ddls = [DistributedDL(dl, r, 4, pad=False) for r in range(4)]
    assert [len(d) for d in ddls] == [3] * 4
    assert sorted(i for d in ddls for b in d for i in b.tolist()) == list(range(48))

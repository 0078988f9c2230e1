"""Planning an epoch as an int64 tensor: the same order as iterating the sampler, 1/W of it kept."""

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler, TensorDataset

from unison.data import DistributedDL
from unison.data.drawn import DrawnOrder
from unison.data.permutation import PermutedOrder
from unison.data.plan import PositionPlan, dealt_plan, sampler_order, strided_plan


@pytest.mark.parametrize("num_samples", [None, 7, 25, 40])
def test_fast_random_order_is_what_iterating_the_sampler_gives(num_samples):
    data = range(10)
    sampler = RandomSampler(data, num_samples=num_samples)
    fast = sampler_order(sampler, seed=5, epoch=0)
    sampler.generator = torch.Generator().manual_seed(5)
    assert isinstance(fast, torch.Tensor) and fast.dtype == torch.long
    assert fast.tolist() == list(sampler)
    sequential = sampler_order(SequentialSampler(data), 0, 0)  # the identity, evaluated per position
    assert isinstance(sequential, PermutedOrder) and list(sequential) == list(range(10))


class Odd(Sampler):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n // 2

    def __iter__(self):
        return iter(range(1, self.n, 2))


def test_any_int_sampler_becomes_a_tensor_and_other_keys_stay_a_list():
    assert sampler_order(Odd(7), 0, 0).tolist() == [1, 3, 5]
    assert sampler_order(["a", "b"], 0, 0) == ["a", "b"]


def _old_plan(n, rank, world, bs, pad):
    """The Python-list plan the tensor plan replaced: positions r, r+W, ... (wrapped when padding)."""
    order = list(range(100, 100 + n))
    if pad:
        items = -(-n // world)
        positions = [rank + world * j for j in range(items)]
        return [[order[p % n] for p in positions[k : k + bs]] for k in range(0, items, bs)]
    batches = []
    for k in range(-(-n // (world * bs))):
        first = k * world * bs + rank
        share = [order[p] for p in range(first, first + world * bs, world) if p < n]
        batches.append(share or [order[k % n]])
    return batches


@pytest.mark.parametrize(("n", "world", "bs"), [(50, 3, 4), (7, 2, 3), (2, 3, 1), (101, 2, 16)])
@pytest.mark.parametrize("pad", [True, False])
def test_strided_tensor_plan_equals_the_list_plan(n, world, bs, pad):
    order = torch.arange(100, 100 + n)
    for rank in range(world):
        expected = _old_plan(n, rank, world, bs, pad)
        plan = strided_plan(order, rank, world, bs, len(expected), pad)
        assert list(plan.batches()) == expected
        assert sum(plan.real) == len(range(rank, n, world))  # every real item of the rank, once


def test_a_ranks_plan_holds_a_tensor_of_its_share_only():
    ddl = DistributedDL(DataLoader(TensorDataset(torch.arange(1000)), batch_size=10, shuffle=True), 1, 4)
    batches = [b[0] for b in ddl]
    plan = ddl._rank_plan
    assert isinstance(plan.items, torch.Tensor) and plan.items.dtype == torch.long
    assert len(plan.items) == 250 and torch.equal(torch.cat(batches), plan.items)


def test_dealt_plan_gives_each_rank_a_slice_of_every_batch():
    batches = [[0, 1, 2, 3, 4], [5, 6], [7]]
    parts = [dealt_plan(batches, r, 3) for r in range(3)]
    assert [list(p.batches()) for p, _ in parts] == [
        [[0, 3], [5], [7]],
        [[1, 4], [6], [7]],
        [[2], [5], [7]],
    ]
    assert [p.real for p, _ in parts] == [[2, 1, 1], [2, 1, 0], [1, 0, 0]]
    assert parts[0][1] == [5, 2, 1]


PLAN_CASES = [(50, 3, 4), (7, 2, 3), (2, 3, 1), (101, 2, 16), (40000, 3, 7)]


@pytest.mark.parametrize(("n", "world", "bs"), PLAN_CASES)
@pytest.mark.parametrize("pad", [True, False])
def test_a_position_plan_gives_the_tensor_plans_batches(n, world, bs, pad):
    """The constant-memory order planned per position equals the same order drawn whole and strided
    (40,000 items: batches that straddle the chunks evaluated at once)."""
    order = PermutedOrder(n, key=3)
    whole = order.at(torch.arange(n))
    for rank in range(world):
        n_batches = len(_old_plan(n, rank, world, bs, pad))
        expected = strided_plan(whole, rank, world, bs, n_batches, pad)
        plan = strided_plan(order, rank, world, bs, n_batches, pad)
        assert isinstance(plan, PositionPlan) and len(plan) == len(expected)
        assert list(plan.batches()) == list(expected.batches())
        assert list(plan.real) == expected.real
        assert list(plan.batches(start=n_batches // 2)) == list(expected.batches(start=n_batches // 2))


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: RandomSampler(range(7)),
        lambda: RandomSampler(range(7), num_samples=14),  # whole permutations, then torch's last draw
        lambda: RandomSampler(range(7), num_samples=10, generator=torch.Generator().manual_seed(1)),
        lambda: RandomSampler(range(7), replacement=True),  # drawn by iterating, seeded from the global RNG
        lambda: SequentialSampler(range(7)),
    ],
)
def test_drawn_order_replays_the_plain_loops_epochs(sampler):
    """DrawnOrder gives each epoch the order the user's own loader draws in it, without a generator
    too (then from the global generator as it stood at hand-over), whatever the RNG does meanwhile."""
    torch.manual_seed(5)
    dl = DataLoader(range(7), batch_size=2, sampler=sampler())
    drawn = DrawnOrder(dl)
    plain = [[int(i) for batch in dl for i in batch] for _ in range(3)]
    torch.manual_seed(99)
    assert [[int(i) for i in drawn.order(dl.sampler, epoch)] for epoch in range(3)] == plain

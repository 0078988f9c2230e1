"""The constant-memory order: a bijection of [0, n), a shuffle as uniform as torch.randperm by the
tests below, and evaluated per position at any n."""

import pytest
import torch
from scipy.stats import chi2, norm
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler

from unison.data import permutation
from unison.data.permutation import (
    PermutedOrder,
    ScalableRandomSampler,
    draw_key,
    many_orders,
    pick_order,
)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 10, 16, 17, 31, 32, 33, 1000, 4097, 65537])
def test_every_position_maps_to_a_distinct_item(n):
    for key in range(3):
        order = PermutedOrder(n, key)
        items = order.at(torch.arange(n))
        assert torch.equal(items.sort().values, torch.arange(n))  # each of 0..n-1 exactly once
        assert list(order) == items.tolist()
    assert n < 10 or PermutedOrder(n, 0)[:] != PermutedOrder(n, 1)[:]  # the key changes the order


def test_positions_evaluated_alone_agree_with_the_whole_order():
    order = PermutedOrder(1000, key=9)
    whole = order[:]
    picks = torch.tensor([999, 0, 500, 7, 7])
    assert order.at(picks).tolist() == [whole[i] for i in picks.tolist()]
    assert order[-1] == whole[-1] and order[3] == whole[3]
    with pytest.raises(IndexError, match="outside an order of 1000"):
        order[1000]


def test_huge_orders_need_no_memory_and_stay_in_range():
    n = 10**10
    order = PermutedOrder(n, key=2)
    positions = torch.arange(n - 5000, n)
    items = order.at(positions)
    assert ((items >= 0) & (items < n)).all() and len(set(items.tolist())) == 5000
    # Not the identity nor a shift: the items of consecutive positions are scattered.
    assert (items[1:] - items[:-1]).abs().float().median() > n / 100


def _position_value_p(perms):
    """Chi-square of the position-value table of K orders of n. A permutation matrix's counts are
    doubly constrained: Pearson's statistic is n/(n-1) times a chi-square with (n-1)^2 df."""
    k, n = perms.shape
    table = torch.zeros(n, n, dtype=torch.float64)
    ones = torch.ones(k * n, dtype=torch.float64)
    table.index_put_((torch.arange(n).repeat(k), perms.reshape(-1)), ones, accumulate=True)
    expected = k / n
    stat = float(((table - expected) ** 2 / expected).sum()) * (n - 1) / n
    return chi2.sf(stat, (n - 1) ** 2)


def _pairwise_order_p(perms):
    """For every pair of positions i < j, how often item(i) < item(j): binomial(K, 1/2) each;
    the largest deviation, Bonferroni-corrected over the n(n-1)/2 pairs."""
    k, n = perms.shape
    i, j = torch.triu_indices(n, n, 1)
    less = (perms[:, i] < perms[:, j]).sum(0).double()
    z = float(((less - k / 2) / (k / 4) ** 0.5).abs().max())
    return min(1.0, 2 * norm.sf(z) * len(i))


def _displacement_p(perms, bins=20):
    """Chi-square of the displacement (item - position) mod n, in `bins` bins: uniform on [0, n)."""
    k, n = perms.shape
    shift = (perms - torch.arange(n)) % n
    counts = torch.bincount(shift.reshape(-1) * bins // n, minlength=bins).double()
    expected = k * torch.bincount(torch.arange(n) * bins // n, minlength=bins).double()  # k*n/n per value
    return chi2.sf(float(((counts - expected) ** 2 / expected).sum()), bins - 1)


@pytest.mark.parametrize("n", [3, 5, 6, 10, 16, 17, 50])
def test_a_shuffle_as_uniform_as_randperm(n):
    """4,000 keyed orders pass the tests 4,000 torch.randperm draws pass (fixed keys and seeds: the
    p-values are deterministic). With 8 Feistel rounds instead of 24, the 6-item domain fails the
    first (p = 5e-5 here, 6e-7 at 20,000 keys): tiny domains take 24."""
    k = 4000
    ours = many_orders(n, list(range(k)))
    g = torch.Generator().manual_seed(n)
    reference = torch.stack([torch.randperm(n, generator=g) for _ in range(k)])
    for perms in (ours, reference):
        assert _position_value_p(perms) > 1e-4
        assert _pairwise_order_p(perms) > 1e-4
        assert _displacement_p(perms, bins=min(n, 20)) > 1e-4


def test_the_tests_can_fail():
    """The statistics above reject orders that are not shuffles: a rotation, and a shuffle of halves."""
    n, k = 16, 4000
    shifts = torch.randint(0, n, (k, 1), generator=torch.Generator().manual_seed(0))
    rotations = (torch.arange(n) + shifts) % n  # every position uniform, but order is kept
    assert _position_value_p(rotations) > 1e-4 and _pairwise_order_p(rotations) < 1e-6
    g = torch.Generator().manual_seed(1)
    halves = torch.stack([torch.cat([torch.randperm(8, generator=g), 8 + torch.randperm(8, generator=g)])])
    halves = halves.repeat(k, 1)
    assert _position_value_p(halves) < 1e-6


def test_large_n_displacement_and_neighbours():
    n, k = 100_003, 8  # cycle walking: n a little above 3/4 of a power of two
    perms = torch.stack([PermutedOrder(n, key).at(torch.arange(n)) for key in range(100, 100 + k)])
    assert _displacement_p(perms, bins=50) > 1e-4
    neighbours_in_order = (perms[:, 1:] > perms[:, :-1]).double().mean()
    assert abs(float(neighbours_in_order) - 0.5) < 0.005  # 800k pairs: sd 0.0006


def test_the_sampler_yields_the_keyed_order_of_its_generator():
    data = range(37)
    got = list(ScalableRandomSampler(data, generator=torch.Generator().manual_seed(4)))
    key = draw_key(torch.Generator().manual_seed(4))
    assert got == PermutedOrder(37, key)[:] and sorted(got) == list(range(37))
    batches = [b.tolist() for b in DataLoader(list(data), batch_size=8, sampler=ScalableRandomSampler(data))]
    assert sorted(sum(batches, [])) == list(range(37))


def test_pick_order(monkeypatch, capsys):
    small = RandomSampler(range(100))
    assert pick_order("auto", small, 4, announce=True) == "torch"
    assert pick_order("scalable", small, 4) == "scalable"
    assert pick_order("auto", ScalableRandomSampler(range(100)), 4) == "scalable"
    assert pick_order("torch", ScalableRandomSampler(range(100)), 4) == "torch"
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(permutation, "ORDER_MEMORY_BYTES", 799)  # 100 items take 800 bytes
    assert pick_order("auto", small, 4, announce=True) == "scalable"
    assert pick_order("torch", small, 4) == "torch"
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "shuffling 100 items" in line and 'order="torch"' in line
    assert pick_order("auto", small, 4, announce=False) == "scalable"
    assert capsys.readouterr().err == ""
    # Not a plain shuffle of every item once: torch's order, whatever its size.
    assert pick_order("auto", RandomSampler(range(100), num_samples=50), 4) == "torch"
    assert pick_order("auto", small, None) == "torch"


@pytest.mark.parametrize(
    ("sampler", "batch_size", "message"),
    [
        (WeightedRandomSampler([1.0] * 10, 10), 4, "got WeightedRandomSampler"),
        (RandomSampler(range(10), replacement=True), 4, "got RandomSampler"),
        (RandomSampler(range(10)), None, "got a batch_sampler"),
    ],
)
def test_scalable_refuses_what_it_cannot_shuffle(sampler, batch_size, message):
    with pytest.raises(ValueError, match=message):
        pick_order("scalable", sampler, batch_size)


def test_unknown_order_names_the_choices():
    with pytest.raises(ValueError, match="order must be one of 'auto', 'torch', 'scalable', got 'fast'"):
        pick_order("fast", RandomSampler(range(4)), 2)

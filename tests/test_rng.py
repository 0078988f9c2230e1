"""Seeding on GPU machines, proved on the CPU (torch queues CUDA seeds until CUDA starts)."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from unison import set_seed
from unison.data.loader import DistributedDL


def _queued_cuda_seed_all():
    # torch keeps the latest `cuda.manual_seed_all` until CUDA initialises; here (no GPU) it stays queued.
    return torch.cuda._lazy_seed_tracker.manual_seed_all_cb


def test_the_data_order_does_not_reseed_the_gpus():
    torch.cuda.manual_seed_all(7)  # the user's (per-rank) GPU seed
    before = _queued_cuda_seed_all()
    dl = DistributedDL(DataLoader(range(10), shuffle=True), 0, 2)
    order = dl.global_order(0)
    assert sorted(order) == list(range(10))
    assert _queued_cuda_seed_all() is before  # was: every rank's GPUs reseeded with the data seed


def test_the_data_order_leaves_the_cpu_generator_as_it_was():
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    DistributedDL(DataLoader(range(10), shuffle=True), 1, 2).global_order(3)
    assert torch.equal(torch.rand(2), expected)


def test_deterministic_sets_the_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_seed(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        set_seed(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the user's choice is kept
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_set_seed_refuses_bad_seeds(bad):
    with pytest.raises(ValueError, match="non-negative int"):
        set_seed(bad)

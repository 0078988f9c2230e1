"""The launcher's shims for the torch releases unison runs on (torch 2.11's agent has no SIGTERM grace)."""

import dataclasses

import pytest
from torch.distributed.launcher.api import LaunchConfig

from unison.launch import torch_compat
from unison.launch.options import LaunchError

FIELDS = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 2}


def test_this_torch_takes_the_grace_and_gets_it():
    assert torch_compat.TAKES_SHUTDOWN_TIMEOUT == (
        "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    )
    if torch_compat.TAKES_SHUTDOWN_TIMEOUT:  # torch 2.13, what CI runs
        config = torch_compat.launch_config(**FIELDS, shutdown_timeout=7)
        assert torch_compat.shutdown_grace(config) == 7


def test_a_torch_without_the_field_gets_its_default_and_a_users_grace_is_refused(monkeypatch):
    monkeypatch.setattr(torch_compat, "TAKES_SHUTDOWN_TIMEOUT", False)
    config = torch_compat.launch_config(**FIELDS, shutdown_timeout=7)  # unison's own default: dropped
    assert config.nproc_per_node == 2
    assert torch_compat.shutdown_grace(config) != 7
    with pytest.raises(LaunchError, match=r"--shutdown-timeout needs torch >= 2.13 \(this is "):
        torch_compat.launch_config(**FIELDS, shutdown_timeout=7, user_grace=True)

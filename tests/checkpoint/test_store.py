"""One save/load pair for both formats (checkpoint/store.py), in process: what is saved comes back
into another model, from a file or a DCP folder, and a refused newest falls back to the kept previous."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from unison import CheckpointError
from unison.checkpoint.components import Group
from unison.checkpoint.store import Weights, find, load_weights, save
from unison.distributed import Collective


def _trained(seed: int) -> Weights:
    """A model and an Adam optimizer with state: one step on a fixed batch."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(3, 4)).square().sum().backward()
    opt.step()
    return Weights(model, model, opt)


def _fresh() -> Weights:
    model = nn.Linear(4, 2)
    return Weights(model, model, torch.optim.Adam(model.parameters(), lr=0.5))


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_what_is_saved_loads_into_another_model_in_either_format(fmt, tmp_path):
    saved = _trained(0)
    written = save(tmp_path / "c.pth", fmt, saved, {"epoch": 3}, Collective())
    assert written == tmp_path / ("c.dcp" if fmt == "dcp" else "c.pth")
    into = _fresh()
    found = find(tmp_path / "c.pth", fmt, into, Collective())
    assert found is not None and found.state["epoch"] == 3 and found.sharded == (fmt == "dcp")
    load_weights(found, into, fmt, Collective())
    for a, b in zip(saved.model.parameters(), into.model.parameters(), strict=True):
        assert torch.equal(a, b)
    exp_avg = [into.opt.state[p]["exp_avg"] for p in into.model.parameters()]
    assert all(
        torch.equal(e, saved.opt.state[p]["exp_avg"])
        for e, p in zip(exp_avg, saved.model.parameters(), strict=True)
    )
    assert into.opt.param_groups[0]["lr"] == 0.01  # the saved hyper-parameters


def test_a_dcp_folder_loads_into_a_plain_model_when_there_is_no_file(tmp_path):
    saved = _trained(1)
    save(tmp_path / "c.pth", "dcp", saved, {"epoch": 1}, Collective())
    into = _fresh()
    found = find(tmp_path / "c.pth", "file", into, Collective())
    assert found is not None and found.sharded
    load_weights(found, into, "file", Collective())
    assert torch.equal(into.model.weight, saved.model.weight)


def test_nothing_saved_is_none_and_a_model_that_does_not_fit_is_refused(tmp_path):
    assert find(tmp_path / "c.pth", "file", _fresh(), Collective()) is None
    save(tmp_path / "c.pth", "file", _trained(0), {}, Collective())
    other = nn.Linear(5, 2)
    with pytest.raises(CheckpointError, match=r"c\.pth does not fit this model: weight has shape \(2, 4\)"):
        find(tmp_path / "c.pth", "file", Weights(other, other, None), Collective())


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_refused_newest_falls_back_to_the_kept_previous(fmt, tmp_path):
    file = tmp_path / "c.pth"
    save(file, fmt, _trained(0), {"epoch": 1}, Collective(), keep_previous=True)
    save(file, fmt, _trained(1), {"epoch": 2}, Collective(), keep_previous=True)
    newest = tmp_path / ("c.dcp/unison.pth" if fmt == "dcp" else "c.pth")
    newest.write_bytes(newest.read_bytes()[:-10])  # cut short
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        find(file, fmt, _fresh(), Collective())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = find(file, fmt, _fresh(), Collective(), keep_previous=True)
    assert found is not None and found.state["epoch"] == 1
    assert found.source == tmp_path / ("c.prev.dcp" if fmt == "dcp" else "c.prev.pth")
    assert any("resuming from the previous checkpoint" in str(w.message) for w in caught)


def test_a_group_saves_its_states_by_name_and_keeps_the_optimizers_hyperparameters():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    for _ in range(3):
        opt.step()
        sched.step()
    states = Group({"sched": sched, "empty": Group({})}, skip_empty=True).state_dict()
    assert list(states) == ["sched"] and states["sched"]["last_epoch"] == 3
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.7)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=5)
    Group({"sched": sched2}, keep=opt2).load_state_dict(states)
    assert sched2.last_epoch == 3 and sched2.step_size == 2
    assert opt2.param_groups[0]["lr"] == 0.7  # kept: the scheduler's load does not write it

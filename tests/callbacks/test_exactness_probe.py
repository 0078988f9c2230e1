"""The probe `unison check-exact` puts in a Learner: stops after K steps, records what it reached.

One process, in this test's process: the probe is on when `UNISON_EXACT_PROBE` is set, and the
record is checked against the same training written out by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner
from unison.callbacks import exactness_probe
from unison.callbacks.exactness_probe import FLOAT64_ENV, PROBE_ENV, STEPS_ENV, ExactnessProbe


@pytest.fixture
def probe_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The environment `unison check-exact` gives a run; a fresh process's first fit."""
    path = tmp_path / "record.pt"
    monkeypatch.setenv(PROBE_ENV, str(path))
    monkeypatch.setenv(STEPS_ENV, "3")
    monkeypatch.delenv(FLOAT64_ENV, raising=False)
    monkeypatch.setattr(exactness_probe, "_claimed", [False])
    dtype = torch.get_default_dtype()
    yield path
    torch.set_default_dtype(dtype)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g)


def learner(x: torch.Tensor, y: torch.Tensor) -> Learner:
    torch.manual_seed(1)
    model = nn.Linear(3, 1)
    dls = DataLoaders(
        DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=40)
    )
    return Learner(dls, model, nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.1)


def by_hand(
    x: torch.Tensor, y: torch.Tensor, steps: int, dtype: torch.dtype
) -> tuple[nn.Linear, list[float]]:
    torch.manual_seed(1)
    model = nn.Linear(3, 1).to(dtype)
    x, y = x.to(dtype), y.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        loss = nn.functional.mse_loss(model(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_nothing_changes_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROBE_ENV, raising=False)
    learn = learner(*data())
    assert learn.get_cb(ExactnessProbe) is None


def test_the_probe_stops_after_k_steps_and_records_them(probe_env: Path) -> None:
    x, y = data()
    learn = learner(x, y)
    with pytest.raises(SystemExit) as stop:
        learn.fit(2)  # 5 steps an epoch; the probe ends the fit, and the script, after 3
    assert stop.value.code == 0
    record = torch.load(probe_env, weights_only=True)
    model, losses = by_hand(x, y, 3, torch.float32)
    assert record["steps"] == 3 and record["world_size"] == 1 and record["batch_size"] == 8
    torch.testing.assert_close(record["weights"]["weight"], model.weight.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(record["weights"]["bias"], model.bias.detach(), rtol=1e-6, atol=1e-7)
    assert record["losses"] == pytest.approx(losses, rel=1e-6)
    # The epoch's validation ran on the weights after step 3: its loss over the whole set.
    valid = nn.functional.mse_loss(model(x), y).item()
    assert record["metric_names"][:2] == ["train_loss", "valid_loss"]
    assert record["values"][-1][1] == pytest.approx(valid, rel=1e-6)
    torch.manual_seed(1)
    start = nn.Linear(3, 1)
    assert torch.equal(record["initial"]["weight"][0], start.weight.detach().double().sum())


def test_float64_trains_the_model_and_the_batches_in_float64(
    probe_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FLOAT64_ENV, "1")
    x, y = data()  # float32 data: the probe makes each batch float64
    learn = learner(x, y)
    assert learn.model.weight.dtype == torch.float64  # at construction, before any wrapper
    with pytest.raises(SystemExit):
        learn.fit(1)
    assert torch.get_default_dtype() == torch.float32  # the fit's float64 default is undone
    record = torch.load(probe_env, weights_only=True)
    model, losses = by_hand(x, y, 3, torch.float64)
    assert record["float64"] and record["weights"]["weight"].dtype == torch.float64
    torch.testing.assert_close(record["weights"]["weight"], model.weight.detach(), rtol=1e-13, atol=1e-15)
    assert record["losses"] == pytest.approx(losses, rel=1e-13)


def test_only_the_first_fit_is_probed(probe_env: Path) -> None:
    x, y = data()
    learn = learner(x, y)
    with pytest.raises(SystemExit):
        learn.fit(1)
    other = learner(x, y)
    other.fit(1)  # a later fit in the same process trains as usual
    assert len(other.recorder.losses) == 5


def test_an_lr_find_before_the_fit_is_not_probed_and_the_fit_is(probe_env: Path) -> None:
    # fastai's tutorial order: lr_find, then fit. The sweep puts model and optimizer back; the
    # record is the fit's first steps, as a script without the sweep gives them.
    x, y = data()
    learn = learner(x, y)
    learn.lr_find(num_it=3)
    assert not probe_env.exists()
    with pytest.raises(SystemExit):
        learn.fit(1)
    record = torch.load(probe_env, weights_only=True)
    model, losses = by_hand(x, y, 3, torch.float32)
    assert record["steps"] == 3
    torch.testing.assert_close(record["weights"]["weight"], model.weight.detach(), rtol=1e-6, atol=1e-7)
    assert record["losses"] == pytest.approx(losses, rel=1e-6)

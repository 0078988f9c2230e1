"""An empty train set is refused at fit, naming the loader, before anything changes."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner


def _learner(n_train, batch_size=4, drop_last=False):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n_train + 8, 4, generator=g), torch.zeros(n_train + 8, dtype=torch.long)
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=batch_size, drop_last=drop_last)
    valid = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=4)
    return Learner(DataLoaders(train, valid), nn.Linear(4, 2), nn.CrossEntropyLoss())


@pytest.mark.parametrize(
    "n_train,drop_last,why",
    [
        (0, False, r"train loader \(dls.train\) is empty: its dataset \(TensorDataset\) has 0 items"),
        (3, True, r"\(dls.train\) yields no batch: 3 item\(s\) with batch_size=4 and drop_last=True"),
    ],
)
def test_an_empty_train_set_is_refused_at_fit_naming_the_loader(n_train, drop_last, why):
    learn = _learner(n_train, drop_last=drop_last)
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=why):
        learn.fit(1)
    assert learn.opt is None  # refused before fit made anything
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())


def test_a_train_set_of_one_item_still_trains():
    learn = _learner(1)
    learn.fit(1)
    assert len(learn.recorder.values) == 1


def _empty_under_distrib_ctx():
    learn = _learner(0)
    try:
        with learn.distrib_ctx():
            learn.fit(1)
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_an_empty_train_set_is_refused_on_every_rank(pool2):
    got = pool2.run(_empty_under_distrib_ctx)
    assert all("(dls.train) is empty" in message for message in got), got

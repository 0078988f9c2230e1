"""The Learner's exact loss with torch's own cross-entropy: class weights and ignored targets, whose
mean is not over the batch's rows. Each run is compared with a plain one-process loop."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import DataLoaders, Learner, TokenCrossEntropy, set_seed

WEIGHT = torch.tensor([1.0, 3.0], dtype=torch.float64)


def _data(ignored=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    if ignored == "share":  # rank 1's share of the first global batch (positions 1, 3, 5, 7) unlabelled
        y[torch.tensor([1, 3, 5, 7, 12])] = -100
    elif ignored:  # unlabelled rows, more of them at even positions: ranks score unevenly
        y[torch.tensor([0, 2, 4, 6, 9, 12, 14, 20])] = -100
    return x, y


def _learner(loss_func, world, ignored=False):
    set_seed(0)
    x, y = _data(ignored)
    bs = 8 // world
    dls = DataLoaders(
        DataLoader(TensorDataset(x, y), batch_size=bs), DataLoader(TensorDataset(x, y), batch_size=bs)
    )
    return Learner(dls, nn.Linear(4, 2).double(), loss_func, lr=0.5, opt_func=torch.optim.SGD)


def _plain(loss, ignored=False):
    """One process, no unison: four steps of 8 rows, the loss torch's mean; then the mean over the set."""
    set_seed(0)
    x, y = _data(ignored)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for first in range(0, 32, 8):
        loss(model(x[first : first + 8]), y[first : first + 8]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model.weight.detach().clone(), float(loss(model(x), y))


def _fit(kind):
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = kind == "tokens"
    learn = _learner(
        TokenCrossEntropy() if tokens else nn.CrossEntropyLoss(weight=WEIGHT), world, _IGNORED[kind]
    )
    ctx = learn.distrib_ctx() if world > 1 else contextlib.nullcontext()
    with contextlib.redirect_stdout(io.StringIO()), ctx:
        learn.fit(1)
        (valid_loss,) = learn.validate()
    return learn.raw_model.weight.detach().clone(), valid_loss


_IGNORED = {"weighted": False, "tokens": True, "weighted-ignored": "share"}


@pytest.mark.parametrize("kind", ["weighted", "tokens", "weighted-ignored"])
def test_class_weights_and_ignored_targets_train_and_validate_as_one_process_on_two(pool2, kind):
    """A class-weighted mean divides by the scored rows' weights, not the rows: counted so, the
    global batch's mean is the one a single process takes (each rank's mean weighted by its rows
    was not). Ignored targets: `TokenCrossEntropy`, which the refusal below names."""
    loss = nn.CrossEntropyLoss() if kind == "tokens" else nn.CrossEntropyLoss(weight=WEIGHT)
    want_w, want_valid = _plain(loss, ignored=_IGNORED[kind])
    tol = 1e-6 if kind == "tokens" else 1e-12  # (TokenCrossEntropy computes in float32)
    for weight, valid_loss in [_fit(kind), *pool2.run(_fit, kind)]:
        torch.testing.assert_close(weight, want_w, rtol=0, atol=tol)
        assert valid_loss == pytest.approx(want_valid, abs=1e-6)  # (the recorder sums in float32)


def test_a_mean_over_targets_that_rows_cannot_count_is_refused_naming_the_fix():
    weighted_function = lambda pred, y: F.cross_entropy(pred, y, weight=WEIGHT)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"^loss_func averages over class weights: .*nn.CrossEntropyLoss\(weight="
    ):
        _learner(weighted_function, 1).fit(1)
    with pytest.raises(
        ValueError,
        match=r"^loss_func leaves out 4 target\(s\) equal to ignore_index=-100: .*TokenCrossEntropy",
    ):
        _learner(nn.CrossEntropyLoss(), 1, ignored=True).fit(1)


def test_a_function_mean_over_targets_is_refused_in_evaluation_too():
    """Evaluation records no autograd graph, so the loss is read again with one: a validate() with no
    fit before it is refused as training is (it reported each rank's mean weighted by its rows)."""
    weighted_function = lambda pred, y: F.cross_entropy(pred, y, weight=WEIGHT)  # noqa: E731
    with pytest.raises(ValueError, match=r"^loss_func averages over class weights: "):
        _learner(weighted_function, 1).validate()
    ignoring_function = lambda pred, y: F.cross_entropy(pred, y)  # noqa: E731
    with pytest.raises(ValueError, match=r"^loss_func leaves out 4 target\(s\) equal to ignore_index=-100: "):
        _learner(ignoring_function, 1, ignored=True).validate()
    plain = _learner(ignoring_function, 1)  # a mean over the rows: read as before
    x, y = _data()
    with torch.no_grad():
        want = float(F.cross_entropy(plain.model(x), y))
    assert plain.validate()[0] == pytest.approx(want, abs=1e-6)


def test_a_loss_summed_over_the_batch_is_refused_naming_the_mean():
    """A sum's gradient on W processes is each rank's share's, averaged: 1/W of one process's
    (weights 1.78 apart after four steps on two processes). A VAE's loss is such a sum."""
    vae_style = lambda pred, y: F.cross_entropy(pred, y, reduction="sum") + 0.1 * pred.pow(2).sum()  # noqa: E731
    for loss_func in [nn.CrossEntropyLoss(reduction="sum"), vae_style]:
        with pytest.raises(ValueError, match=r"^loss_func sums over the batch's rows: .*reduction=\"mean\""):
            _learner(loss_func, 1).fit(1)
    with pytest.raises(ValueError, match=r"^loss_func sums over the batch's rows: "):
        _learner(nn.CrossEntropyLoss(reduction="sum"), 1).validate()


def _masked(pred, y):
    """A hand-written mean over the labelled rows, as token losses are often written."""
    labelled = y != -100
    return (F.cross_entropy(pred, y.clamp(min=0), reduction="none") * labelled).sum() / labelled.sum()


def test_a_mean_over_a_count_of_its_own_is_refused_and_means_over_rows_or_terms_train():
    """A masked mean divides by the rows its mask keeps: weighed by rows, ranks' means were mixed
    unevenly. Dividing by the rows, or by every term, is a mean over the rows."""
    selected = lambda pred, y: F.cross_entropy(pred, y.clamp(min=0), reduction="none")[y != -100].mean()  # noqa: E731
    for loss_func in [_masked, selected]:
        with pytest.raises(
            ValueError, match=r"^loss_func (divides|averages) .*: its mean is not over the batch's rows"
        ):
            _learner(loss_func, 1, ignored=True).fit(1)
    by_rows = lambda pred, y: F.cross_entropy(pred, y, reduction="none").sum() / len(y)  # noqa: E731
    by_terms = lambda pred, y: F.mse_loss(pred, F.one_hot(y, 2).double(), reduction="sum") / (2 * len(y))  # noqa: E731
    for loss_func in [by_rows, by_terms]:
        learn = _learner(loss_func, 1)
        with contextlib.redirect_stdout(io.StringIO()):
            learn.fit(1)


def test_a_loss_of_one_value_per_item_is_refused_naming_the_reduction():
    """torch's own error was "grad can be implicitly created only for scalar outputs"."""
    with pytest.raises(ValueError, match=r"^loss_func returned a tensor of shape \(8,\), not one loss: "):
        _learner(nn.CrossEntropyLoss(reduction="none"), 1).fit(1)

"""Metrics: exact over a whole set whatever the batching, including ones that cannot be averaged."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import AccumMetric, AvgMetric, DataLoaders, Learner, Metric, accuracy, error_rate, roc_auc
from unison.distributed.collective import Collective

SIZES = [5, 3, 8, 1, 11, 2]  # uneven batches, 30 samples


def batches(*tensors, sizes=SIZES):
    start = 0
    for n in sizes:
        yield tuple(t[start : start + n] for t in tensors)
        start += n
    assert start == len(tensors[0])


def binary_data(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 2, generator=g)
    target = torch.randint(0, 2, (n,), generator=g)
    return logits, target


def f1_direct(pred_labels, target):
    tp = int(((pred_labels == 1) & (target == 1)).sum())
    fp = int(((pred_labels == 1) & (target == 0)).sum())
    fn = int(((pred_labels == 0) & (target == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn)


# ---- accuracy and averaged metrics ---------------------------------------------------------


def test_accuracy():
    pred = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert accuracy(pred, torch.tensor([1, 0, 0, 0])).item() == pytest.approx(0.75)
    assert accuracy(pred, torch.tensor([0, 1, 0, 1])).item() == 0.0
    assert error_rate(pred, torch.tensor([1, 0, 0, 0])).item() == pytest.approx(0.25)
    # axis picks the class dimension
    assert accuracy(pred.T, torch.tensor([1, 0, 1, 0]), axis=0).item() == 1.0


def test_avg_metric_weights_batches_by_their_size():
    logits, target = binary_data()
    metric = AvgMetric(accuracy)
    batch_means = []
    for pred, t in batches(logits, target):
        metric.update(pred, t)
        batch_means.append(accuracy(pred, t).item())
    whole = accuracy(logits, target).item()
    assert metric.value(Collective()) == pytest.approx(whole, abs=1e-7)
    assert sum(batch_means) / len(batch_means) != pytest.approx(whole, abs=1e-3)  # naive mean differs
    assert metric.name == "accuracy"
    metric.reset()
    metric.update(logits[:4], target[:4])
    assert metric.value(Collective()) == pytest.approx(accuracy(logits[:4], target[:4]).item())


# ---- metrics that need every prediction -----------------------------------------------------


def f1_score(pred_labels, target):
    """Binary F1 over a whole set, as a user would write it for AccumMetric."""
    tp = ((pred_labels == 1) & (target == 1)).sum()
    fp = ((pred_labels == 1) & (target == 0)).sum()
    fn = ((pred_labels == 0) & (target == 1)).sum()
    return (2 * tp / (2 * tp + fp + fn)).item()


class F1(Metric):
    """Binary F1 from summed counts: exact over any batching and any number of processes."""

    sum_states = ("tp", "fp", "fn")

    def update(self, pred, target):
        labels = pred.argmax(-1)
        self.tp = self.tp + ((labels == 1) & (target == 1)).sum()
        self.fp = self.fp + ((labels == 1) & (target == 0)).sum()
        self.fn = self.fn + ((labels == 0) & (target == 1)).sum()

    def compute(self):
        return 2 * self.tp / (2 * self.tp + self.fp + self.fn)


def test_f1_as_accum_metric_and_as_metric_subclass_equal_the_whole_set_value():
    logits, target = binary_data(seed=1)
    expected = f1_direct(logits.argmax(-1), target)
    accum = AccumMetric(f1_score, activation=lambda p: p.argmax(-1))
    summed = F1()
    batch_f1 = []
    for pred, t in batches(logits, target):
        accum.update(pred, t)
        summed.update(pred, t)
        if ((pred.argmax(-1) == 1) | (t == 1)).any():
            batch_f1.append(f1_direct(pred.argmax(-1), t))
    assert accum.value(Collective()) == pytest.approx(expected, abs=1e-7)
    assert summed.value(Collective()) == pytest.approx(expected, abs=1e-7)
    assert sum(batch_f1) / len(batch_f1) != pytest.approx(expected, abs=1e-3)  # not averageable
    assert accum.name == "f1_score" and summed.name == "f1"
    summed.reset()
    assert float(summed.tp) == 0.0 and float(summed.fp) == 0.0


def roc_auc_brute(scores, target):
    pos = [s for s, t in zip(scores.tolist(), target.tolist(), strict=True) if t == 1]
    neg = [s for s, t in zip(scores.tolist(), target.tolist(), strict=True) if t == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_equals_pairwise_counting_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 2, (60,), generator=g)
    scores = (torch.rand(60, generator=g) + 0.3 * target).mul(5).round() / 5  # few distinct values
    assert len(scores.unique()) < 15
    assert roc_auc(scores, target) == pytest.approx(roc_auc_brute(scores, target), abs=1e-12)


def test_roc_auc_known_values_and_one_class():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 0])) == 0.0
    assert math.isnan(roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1])))  # undefined: one class


def test_accum_roc_auc_over_uneven_batches():
    logits, target = binary_data(n=30, seed=2)
    metric = AccumMetric(roc_auc, activation=lambda p: p.softmax(-1)[:, 1])
    for pred, t in batches(logits, target):
        metric.update(pred, t)
    expected = roc_auc_brute(logits.softmax(-1)[:, 1], target)
    assert metric.value(Collective()) == pytest.approx(expected, abs=1e-12)


# ---- through the Learner -------------------------------------------------------------------


def test_learner_reports_every_kind_of_metric_exactly():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 4, generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(37, generator=g) > 0).long()
    xt = torch.randn(16, 4, generator=g)
    yt = (xt[:, 0] > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(xt, yt), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8)
    )
    torch.manual_seed(0)
    auc = AccumMetric(roc_auc, activation=lambda p: p.softmax(-1)[:, 1])
    learn = Learner(
        dls,
        nn.Linear(4, 2),
        nn.CrossEntropyLoss(),
        lr=0.05,
        metrics=[accuracy, AvgMetric(error_rate), auc, F1()],
    )
    learn.fit(2)
    assert learn.recorder.metric_names == [
        "epoch",
        "train_loss",
        "valid_loss",
        "accuracy",
        "error_rate",
        "roc_auc",
        "f1",
        "time",
    ]
    loss, acc, err, auc_value, f1 = learn.validate()
    with torch.no_grad():
        out = learn.model(x)
    labels = out.argmax(-1)
    assert loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert acc == pytest.approx((labels == y).float().mean().item(), abs=1e-7)
    assert err == pytest.approx(1 - acc, abs=1e-6)
    assert auc_value == pytest.approx(roc_auc_brute(out.softmax(-1)[:, 1], y), abs=1e-9)
    assert f1 == pytest.approx(f1_direct(labels, y), abs=1e-7)
    # validate() again gives the same values: metric state is reset between passes
    assert learn.validate() == pytest.approx([loss, acc, err, auc_value, f1])
    # the last epoch's row holds the same values: the weights have not changed since
    assert learn.recorder.values[-1][1:] == pytest.approx([loss, acc, err, auc_value, f1])

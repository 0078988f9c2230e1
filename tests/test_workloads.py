"""Real workloads, each checked against a plain single-process computation, on 1 and 2 processes:
Hugging Face models and dict batches, per-token losses, get_preds/predict for any output,
torchmetrics, train sets of any size, param groups, torch.compile, loggers."""

import contextlib
import csv
import io
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from unison import (
    AccumMetric,
    Callback,
    CSVLogger,
    DataLoaders,
    GradientAccumulation,
    Learner,
    LRSchedulerCallback,
    TensorBoardLogger,
    TokenCrossEntropy,
    accuracy,
    set_seed,
)
from unison.data.batch import cat_structured, map_tensors, take_rows

VOCAB, MAX_LEN = 50, 12


def quiet():
    return contextlib.redirect_stdout(io.StringIO())


def max_diff(a, b):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def weights(learn):
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


# ---- tiny transformers models, built from a config (nothing downloaded) -------------------


def tiny_bert(num_labels=2):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=MAX_LEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=MAX_LEN,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


class TokenDataset(Dataset):
    """Sequences of 3..12 tokens, right-padded to MAX_LEN; `labels` a class (BERT) or the tokens with
    -100 on padding (causal LM), so ranks hold different numbers of scored tokens."""

    def __init__(self, n, seed, task, with_labels=True):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, MAX_LEN + 1, (n,), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)
        self.mask = (torch.arange(MAX_LEN) < self.lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.cls = (self.ids[:, 0] > VOCAB // 2).long()
        self.task, self.with_labels = task, with_labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.with_labels:
            item["labels"] = (
                self.cls[i] if self.task == "cls" else self.ids[i].masked_fill(self.mask[i] == 0, -100)
            )
        return item


def hf_learner(task, bs, loss_func=None, accumulate=False, n_train=37, n_valid=21, lr=1e-3):
    set_seed(0)
    model = tiny_bert() if task == "cls" else tiny_gpt2()
    dls = DataLoaders(
        DataLoader(TokenDataset(n_train, 1, task), batch_size=bs, shuffle=True),
        DataLoader(TokenDataset(n_valid, 2, task), batch_size=4),
    )
    cbs = [GradientAccumulation(2)] if accumulate else []
    return Learner(dls, model, loss_func, opt_func=torch.optim.AdamW, lr=lr, cbs=cbs)


def true_valid_loss(model, ds):
    """The loss over the whole set as a plain loop would define it: per sample (classification) or
    per scored token (causal LM), over every item at once."""
    batch = {"input_ids": ds.ids, "attention_mask": ds.mask}
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    if ds.task == "cls":
        return F.cross_entropy(logits, ds.cls).item()
    labels = ds.ids.masked_fill(ds.mask == 0, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)).item()


LOSSES = {"own": None, "lambda": lambda out: out.loss, "token": TokenCrossEntropy(shift=True)}


def _hf_parity(task, loss_name, accumulate):
    """W processes with batch 4 against one process with batch 4W: weights, validation, curve."""
    world = dist.get_world_size()
    loss = LOSSES[loss_name]
    single = hf_learner(task, 4 * world, loss, accumulate)
    with quiet():
        single.fit(1)
    one = single.validate()
    multi = hf_learner(task, 4, loss, accumulate)
    with quiet(), multi.distrib_ctx():
        multi.fit(1)
        many = multi.validate()
    truth = true_valid_loss(multi.raw_model, multi.dls.valid.dataset)
    curves = max(abs(a - b) for a, b in zip(single.recorder.losses, multi.recorder.losses, strict=True))
    return max_diff(weights(single), weights(multi)), abs(one[0] - many[0]), abs(many[0] - truth), curves


@pytest.mark.parametrize(
    "task,loss_name,accumulate",
    [("cls", "own", False), ("cls", "lambda", False), ("lm", "own", False), ("lm", "token", True)],
)
def test_transformers_model_trains_and_validates_on_two_processes_as_on_one(
    pool2, task, loss_name, accumulate
):
    pytest.importorskip("transformers")
    for w, v, truth, curve in pool2.run(_hf_parity, task, loss_name, accumulate, timeout=180):
        assert w < 1e-5 and v < 1e-6 and truth < 1e-6 and curve < 1e-6, (w, v, truth, curve)


def plain_token_loop(bs, n_train=37, lr=1e-3):
    """One epoch of a causal LM by hand: each step's loss is the mean over that batch's scored tokens."""
    return token_loop(hf_learner("lm", bs, n_train=n_train, lr=lr), bs, lr)  # same init and data order


def token_loop(learn, bs, lr=1e-3):
    """One epoch by hand over `learn`'s model and data order, AdamW, each step's loss the mean over
    that batch's scored (shifted) tokens; returns the weights under their plain keys."""
    model, ds = learn.model, learn.dls.train.dataset
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    order = learn._shard(learn.dls.train, pad=False).global_order(0)
    model.train()
    for start in range(0, len(order), bs):
        items = [ds[i] for i in order[start : start + bs]]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in learn.raw_model.state_dict().items()}


@pytest.mark.parametrize("loss_name", ["own", "token"])
def test_token_mean_loss_with_gradient_accumulation_equals_one_big_batch(loss_name):
    """Finding 6 on one process: accumulating two micro-batches averaged token means, not tokens."""
    pytest.importorskip("transformers")
    expected = plain_token_loop(8)
    learn = hf_learner("lm", 4, LOSSES[loss_name], accumulate=True)
    with quiet():
        learn.fit(1)
    assert max_diff(expected, weights(learn)) < 1e-5


# ---- get_preds and predict for any output ---------------------------------------------------


def _hf_preds():
    learn = hf_learner("cls", 4, n_valid=9)
    valid = learn.dls.valid.dataset
    with torch.no_grad():
        expected = learn.model.eval()(input_ids=valid.ids, attention_mask=valid.mask).logits
    unlabelled = DataLoader(TokenDataset(9, 2, "cls", with_labels=False), batch_size=4)
    one_item = DataLoader(TokenDataset(1, 4, "cls"), batch_size=4)
    with torch.no_grad():
        one = one_item.dataset
        expected_one = learn.model(input_ids=one.ids, attention_mask=one.mask).logits
    with quiet(), learn.distrib_ctx():
        out, targets = learn.get_preds()
        bare, none = learn.get_preds(unlabelled)
        single, single_targets = learn.get_preds(one_item)
    item = learn.predict(valid[3])
    return (
        type(out).__name__,
        float((out.logits - expected).abs().max()),
        out.loss is None,
        torch.equal(targets, valid.cls),
        float((bare.logits - expected).abs().max()),
        none is None,
        tuple(single.logits.shape),
        float((single.logits - expected_one).abs().max()) + float((single_targets != one.cls).sum()),
        float((item.logits - expected[3]).abs().max()),
    )


def test_get_preds_keeps_a_model_output_on_unlabelled_and_tiny_loaders_and_predict(pool2):
    """Finding 3: dict/ModelOutput outputs, unlabelled loaders and a 1-item loader on 2 ranks."""
    pytest.importorskip("transformers")
    for kind, err, no_loss, same_targets, bare_err, no_targets, one_shape, one_err, item_err in pool2.run(
        _hf_preds, timeout=120
    ):
        assert kind == "SequenceClassifierOutput" and no_loss and same_targets and no_targets
        assert one_shape == (1, 2)
        assert max(err, bare_err, one_err, item_err) < 1e-6


class Tagger(nn.Module):
    """Per-token classes for variable-length sequences: (batch, time) -> (batch, time, 3)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


def pad_collate(items):
    """Pad each batch to its own longest sequence: targets -100 there."""
    longest = max(len(x) for x, _ in items)
    ids = torch.stack([F.pad(x, (0, longest - len(x))) for x, _ in items])
    tags = torch.stack([F.pad(y, (0, longest - len(y)), value=-100) for _, y in items])
    return ids, tags


def token_accuracy(logits, tags):
    keep = tags != -100
    return (logits.argmax(-1)[keep] == tags[keep]).float().mean().item()


def tagging_data(n=23, seed=3):
    g = torch.Generator().manual_seed(seed)
    seqs = [
        torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(n)
    ]
    return [(s, s % 3) for s in seqs]


def _variable_length(distributed):
    data = tagging_data()
    set_seed(0)
    dl = DataLoader(data, batch_size=3, collate_fn=pad_collate)
    loss = lambda logits, tags: F.cross_entropy(logits.transpose(1, 2), tags)  # noqa: E731
    learn = Learner(DataLoaders(dl, dl), Tagger(), loss, metrics=[AccumMetric(token_accuracy)])
    with torch.no_grad():
        truth = sum(int((learn.model(s).argmax(-1) == t).sum()) for s, t in data) / sum(
            len(s) for s, _ in data
        )
    with quiet(), learn.distrib_ctx() if distributed else contextlib.nullcontext():
        preds, tags = learn.get_preds()
        (_, metric) = learn.validate()
    return token_accuracy(preds, tags), metric, truth, int((tags == -100).sum())


def _one_item_validation():
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    dls = make_dls(16, 1, bs=4)
    set_seed(0)
    metrics = [AccumMetric(token_accuracy), accuracy, MulticlassF1Score(2), MulticlassAUROC(2)]
    learn = Learner(dls, nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=metrics)
    x, y = dls.valid.dataset.tensors
    with torch.no_grad():
        logits = learn.model(x)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics: one item has no negative class
        one = learn.validate()
        with learn.distrib_ctx():
            many = learn.validate()
    exact = [F.cross_entropy(logits, y).item(), token_accuracy(logits, y), token_accuracy(logits, y)]
    return one, many, exact


def test_a_set_smaller_than_the_world_validates_exactly_with_every_kind_of_metric(pool2):
    """Finding 3's abort, for metrics: a rank with no item gathered a 1-D empty state (unison's and
    torchmetrics' own sync alike) and the job hung."""
    pytest.importorskip("torchmetrics")
    for one, many, exact in pool2.run(_one_item_validation):
        assert many == pytest.approx(one, abs=1e-6)
        assert many[:3] == pytest.approx(exact, abs=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_variable_length_outputs_are_padded_with_minus_100_never_scored(pool2, world):
    """Finding 4: zero padding read as class 0; AccumMetric crashed on batches of different lengths."""
    results = pool2.run(_variable_length, True) if world == 2 else [_variable_length(False)]
    for from_preds, metric, truth, padded in results:
        assert padded > 0
        assert from_preds == pytest.approx(truth, abs=1e-6)
        assert metric == pytest.approx(truth, abs=1e-6)


def _per_item_losses():
    dls = make_dls(16, 13, bs=4)
    set_seed(0)
    learn = Learner(dls, nn.Linear(4, 2), nn.CrossEntropyLoss())
    x, y = dls.valid.dataset.tensors
    with torch.no_grad():
        expected = F.cross_entropy(learn.model(x), y, reduction="none")
    with quiet(), learn.distrib_ctx():
        _, targets, losses = learn.get_preds(with_loss=True)
    return float((losses - expected).abs().max()), torch.equal(targets, y), learn.loss_func.reduction


def test_get_preds_with_loss_gives_one_loss_per_item_in_order(pool2):
    for err, same_targets, reduction in pool2.run(_per_item_losses) + [_per_item_losses()]:
        assert err < 1e-6 and same_targets and reduction == "mean"
    learn = Learner(make_dls(), nn.Linear(4, 2), lambda p, y: F.cross_entropy(p, y))
    with pytest.raises(ValueError, match="reduction"):
        learn.get_preds(with_loss=True)


# ---- torchmetrics ---------------------------------------------------------------------------


def _torchmetrics_vs_sklearn():
    from sklearn.metrics import f1_score, roc_auc_score
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(101, 4, generator=g), torch.randint(0, 3, (101,), generator=g)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    set_seed(0)
    metrics = [
        MulticlassF1Score(num_classes=3, average="macro"),
        MulticlassAUROC(num_classes=3, average="macro"),
    ]
    learn = Learner(DataLoaders(dl, dl), nn.Linear(4, 3), nn.CrossEntropyLoss(), metrics=metrics)
    with torch.no_grad():
        logits = learn.model(x)
    f1 = f1_score(y.numpy(), logits.argmax(-1).numpy(), average="macro")
    auc = roc_auc_score(y.numpy(), logits.softmax(-1).numpy(), multi_class="ovr", average="macro")
    with quiet():
        _, f1_one, auc_one = learn.validate()
        with learn.distrib_ctx():
            _, f1_many, auc_many = learn.validate()
    return [abs(v - f1) for v in (f1_one, f1_many)] + [abs(v - auc) for v in (auc_one, auc_many)]


def test_torchmetrics_f1_and_auroc_equal_scikit_learn_on_one_and_two_processes(pool2):
    """Finding 5: a torchmetrics Metric was averaged over batches (macro-F1 0.397 against 0.416)."""
    pytest.importorskip("torchmetrics")
    for diffs in pool2.run(_torchmetrics_vs_sklearn):
        assert max(diffs) < 1e-6, diffs


def test_a_metric_collection_gives_one_column_per_metric():
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy

    dls = make_dls(16, 23, bs=5)
    set_seed(0)
    collection = MetricCollection({"acc": MulticlassAccuracy(2, average="micro")})
    learn = Learner(dls, nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=collection)
    x, y = dls.valid.dataset.tensors
    with torch.no_grad():
        expected = (learn.model(x).argmax(-1) == y).float().mean().item()
    assert [m.name for m in learn.metrics] == ["acc"]
    assert learn.validate()[1] == pytest.approx(expected, abs=1e-6)


def test_a_plain_function_that_is_not_a_per_sample_mean_is_refused():
    def f1_score(pred, target):
        return 0.0

    with pytest.raises(ValueError, match="AccumMetric"):
        Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=[f1_score])


def test_a_single_metric_is_accepted():
    learn = Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=accuracy)
    assert [m.name for m in learn.metrics] == ["accuracy"]


# ---- any train-set size: n = 1001 with batch 16 -----------------------------------------------


def make_dls(n_train=16, n_valid=8, bs=8, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_valid, features, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return DataLoaders(
        DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=bs, shuffle=True),
        DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=bs),
    )


class Untagged(nn.Module):
    """The model sees every feature but the last, which tags the item."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x[:, :-1])


class CountItems(Callback):
    def before_fit(self):
        self.seen = []

    def after_pred(self):
        if self.learn.training:
            self.seen += self.learn.xb[0][:, -1].tolist()  # the last feature tags the item


def _any_size(n, model_name, opt_name):
    world = dist.get_world_size()

    def make(bs):
        set_seed(0)
        dls = make_dls(n, 21, bs, features=6)
        x = dls.train.dataset.tensors[0]
        x[:, -1] = torch.arange(n, dtype=x.dtype)  # a tag the model does not read
        # No bias before BatchNorm: its true gradient is 0, and AdamW would turn float noise into steps.
        layers = (
            [nn.Linear(5, 16, bias=False), nn.BatchNorm1d(16)] if model_name == "bn" else [nn.Linear(5, 16)]
        )
        model = Untagged(nn.Sequential(*layers, nn.ReLU(), nn.Linear(16, 2)))
        opt = {"sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), "adamw": torch.optim.AdamW}[
            opt_name
        ]
        return Learner(dls, model, nn.CrossEntropyLoss(), opt_func=opt, lr=1e-2, metrics=[accuracy])

    single = make(16 * world)
    with quiet():
        single.fit(1)
    multi = make(16)
    counter = CountItems()
    with quiet(), multi.distrib_ctx():
        multi.fit(1, cbs=[counter])
        seen = multi.collective.gather_objects(counter.seen)
    items = sorted(int(v) for part in seen for v in part)
    return (
        max_diff(weights(single), weights(multi)),
        items == list(range(n)),
        single.recorder.losses,
        multi.recorder.losses,
    )


@pytest.mark.parametrize(
    "n,model_name,opt_name", [(1001, "mlp", "sgd"), (1001, "bn", "adamw"), (33, "mlp", "adamw")]
)
def test_any_train_set_size_trains_each_item_once_and_equals_one_process(pool2, n, model_name, opt_name):
    """Finding 7 (2004 samples trained instead of 2002) and finding 10 (rank 0's local loss curve).
    n = 33 leaves rank 1 an empty share of the last batch."""
    for diff, each_once, one_curve, many_curve in pool2.run(_any_size, n, model_name, opt_name, timeout=180):
        assert each_once
        assert diff < 1e-5
        assert max(abs(a - b) for a, b in zip(one_curve, many_curve, strict=True)) < 1e-6


# ---- param groups -----------------------------------------------------------------------------


def two_groups(model):
    return [model[0].parameters(), model[2].parameters()]


def group_learner(**kwargs):
    set_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return Learner(make_dls(), model, nn.CrossEntropyLoss(), splitter=two_groups, **kwargs)


class GroupLRs(Callback):
    order = 20  # after the schedulers

    def before_fit(self):
        self.lrs = []

    def before_batch(self):
        if self.learn.training:
            self.lrs.append([g["lr"] for g in self.learn.opt.param_groups])


def test_fit_one_cycle_with_a_slice_keeps_discriminative_lrs():
    """Finding 8: every param group was flattened to one LR."""
    learn = group_learner()
    log = GroupLRs()
    with quiet():
        learn.fit_one_cycle(3, lr_max=slice(1e-4, 1e-2), cbs=[log])
    assert len(log.lrs) == 6
    for lo, hi in log.lrs:
        assert hi / lo == pytest.approx(100)
    assert max(hi for _, hi in log.lrs) <= 1e-2 and max(hi for _, hi in log.lrs) > 0.9e-2


def test_fit_with_lr_keeps_the_ratios_the_optimizer_was_built_with():
    def opt_func(groups, lr):
        body, head = groups
        return torch.optim.SGD([{**body, "lr": lr / 10}, head], lr=lr)

    learn = group_learner(opt_func=opt_func, lr=0.1)
    learn.create_opt()
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([0.01, 0.1])
    with quiet():
        learn.fit(1, lr=0.5)
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([0.05, 0.5])
    learn.set_lr([0.2, 0.4])
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([0.2, 0.4])
    learn.set_lr(1.0)  # a float keeps the latest ratios
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([0.5, 1.0])


def test_a_torch_lr_scheduler_is_stepped_after_every_optimizer_step():
    learn = group_learner(lr=0.1)
    log = GroupLRs()
    sched = LRSchedulerCallback(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    with quiet():
        learn.fit(2, cbs=[sched, log])
    assert [lrs[0] for lrs in log.lrs] == pytest.approx([0.1 * 0.5**i for i in range(4)])


# ---- torch.compile ------------------------------------------------------------------------------


def test_a_compiled_model_saves_keys_an_uncompiled_model_loads(tmp_path):
    """Finding 9: `_orig_mod.`-prefixed keys."""
    set_seed(0)
    compiled = torch.compile(nn.Linear(4, 2), backend="eager")
    learn = Learner(make_dls(), compiled, nn.CrossEntropyLoss(), path=tmp_path)
    with quiet():
        learn.fit(1)
    file = learn.save("compiled")
    plain = Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), path=tmp_path).load("compiled")
    assert set(torch.load(file, weights_only=True)["model"]) == {"weight", "bias"}
    assert torch.equal(plain.model.weight, compiled._orig_mod.weight)


def _compiled_parity():
    world = dist.get_world_size()
    plain = Learner(make_dls(32, bs=8 * world, seed=4), _seeded_mlp(), nn.CrossEntropyLoss(), lr=1e-2)
    with quiet():
        plain.fit(1)
    dls = make_dls(32, bs=8, seed=4)
    compiled = Learner(dls, _seeded_mlp(), nn.CrossEntropyLoss(), lr=1e-2, compile={"backend": "eager"})
    with quiet(), compiled.distrib_ctx():
        compiled.fit(1)
    keys = set(compiled.raw_model.state_dict())
    return max_diff(weights(plain), weights(compiled)), keys == set(plain.model.state_dict())


def _seeded_mlp():
    set_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_compile_option_under_ddp_equals_one_plain_process(pool2):
    for diff, same_keys in pool2.run(_compiled_parity, timeout=180):
        assert same_keys and diff < 1e-5


# ---- logging ------------------------------------------------------------------------------------


def test_plot_loss_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    learn = Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), path=tmp_path)
    with quiet():
        learn.fit(1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r"unison\[examples\]"):
        learn.recorder.plot_loss(tmp_path / "loss.png")


def test_csv_and_tensorboard_loggers_write_what_the_recorder_holds(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    learn = Learner(make_dls(), nn.Linear(4, 2), nn.CrossEntropyLoss(), metrics=[accuracy], path=tmp_path)
    with quiet():
        learn.fit(2, cbs=[CSVLogger(), TensorBoardLogger("tb")])
    with open(tmp_path / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["valid_loss"]) for r in rows] == pytest.approx([v[1] for v in learn.recorder.values])
    assert [float(r["accuracy"]) for r in rows] == pytest.approx([v[2] for v in learn.recorder.values])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/batch_loss")]
    assert logged == pytest.approx(learn.recorder.losses)


class NoLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


class DictItems(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def test_a_dict_batch_gives_its_labels_to_the_loss_and_metrics_not_to_a_model_without_them():
    dls = make_dls(16, 8)
    (xt, yt), (xv, yv) = dls.train.dataset.tensors, dls.valid.dataset.tensors
    dls = DataLoaders(
        DataLoader(DictItems(xt, yt), batch_size=8), DataLoader(DictItems(xv, yv), batch_size=3)
    )
    set_seed(0)
    learn = Learner(dls, NoLabels(), nn.CrossEntropyLoss(), metrics=[accuracy])
    with quiet():
        learn.fit(1)
    valid_loss, acc = learn.validate()
    with torch.no_grad():
        logits = learn.model(xv)
    assert valid_loss == pytest.approx(F.cross_entropy(logits, yv).item(), abs=1e-6)
    assert acc == pytest.approx((logits.argmax(-1) == yv).float().mean().item(), abs=1e-6)


# ---- batch structure ------------------------------------------------------------------------------


def test_batch_transforms_keep_model_output_and_namedtuple_classes():
    """Finding 1's crash: `take_rows` rebuilt a ModelOutput as a plain dict."""
    pytest.importorskip("transformers")
    from collections import namedtuple

    from transformers.modeling_outputs import SequenceClassifierOutput

    Pair = namedtuple("Pair", "a b")
    out = SequenceClassifierOutput(loss=torch.tensor(1.0), logits=torch.arange(6.0).view(3, 2))
    for value in (out, Pair(torch.ones(3), [torch.zeros(3, 1)])):
        for transformed in (
            take_rows(value, 2),
            map_tensors(torch.clone, value),
            cat_structured([value, value]),
        ):
            assert type(transformed) is type(value)
    assert take_rows(out, 2).loss.item() == 1.0 and take_rows(out, 2).logits.shape == (2, 2)
    assert cat_structured([out, out]).logits.shape == (6, 2) and cat_structured([out, out]).loss is None

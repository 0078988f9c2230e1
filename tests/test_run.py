"""The own-loop API (`unison.Run`) against a plain single-process loop written here: the same weights
on 1 and on W processes at the same global batch (AdamW, BatchNorm, accumulation, odd N, token-counted
losses), every item gathered once in data order, a non-finite loss stopping every rank naming it,
what cannot be exact refused in one line. Kills, preemption and check-exact: tests/test_run_launch.py."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import unison
from unison import NonFiniteError, Run, set_seed

IGNORE = -100


def _data(n: int, features: int = 6, seed: int = 1, tokens: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    if tokens:  # a third of the labels are ignored: the loss counts the others, unevenly per batch
        y[torch.rand(n, generator=g) < 0.33] = IGNORE
    return TensorDataset(x, y)


def _model(bn: bool) -> nn.Module:
    set_seed(0)
    norm = [nn.BatchNorm1d(16)] if bn else []
    return nn.Sequential(nn.Linear(6, 16), *norm, nn.ReLU(), nn.Linear(16, 2)).double()


def _opt(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw-groups":  # nanoGPT's: weight decay on the matrices only, the biases at their own LR
        matrices = [p for p in model.parameters() if p.dim() > 1]
        biases = [p for p in model.parameters() if p.dim() <= 1]
        groups = [
            {"params": matrices, "weight_decay": 0.1},
            {"params": biases, "weight_decay": 0.0, "lr": 0.02},
        ]
        return torch.optim.AdamW(groups, lr=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def plain_loop(ds, global_bs, epochs, bn, opt_kind, accumulate=1):
    """One process, no unison: each optimizer step takes `accumulate` consecutive batches of `global_bs`
    items (sequential order) and steps on the summed loss over the count of its loss terms."""
    model = _model(bn)
    opt = _opt(model, opt_kind)
    x, y = ds.tensors
    n_batches = math.ceil(len(ds) / global_bs)
    for _ in range(epochs):
        model.train()
        for first in range(0, n_batches, accumulate):
            batches = range(first, min(first + accumulate, n_batches))
            count = sum(int((y[b * global_bs : (b + 1) * global_bs] != IGNORE).sum()) for b in batches)
            for b in batches:
                xb, yb = x[b * global_bs : (b + 1) * global_bs], y[b * global_bs : (b + 1) * global_bs]
                loss = F.cross_entropy(model(xb), yb, reduction="sum", ignore_index=IGNORE)
                (loss / count).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_loop(ds, bs, epochs, bn, opt_kind, accumulate=1, **run_options):
    """The same training written with `unison.Run` (per-process batch `bs`)."""
    model = _model(bn)
    with Run(accumulate=accumulate, **run_options) as run:
        model, opt = run.setup(model, _opt(model, opt_kind))
        train = run.loader(DataLoader(ds, batch_size=bs))
        for _ in run.epochs(epochs):
            model.train()
            for x, y in train:
                loss = F.cross_entropy(model(x), y, reduction="sum", ignore_index=IGNORE)
                run.backward(run.loss(loss, count=(y != IGNORE).sum()))
                opt.step()
                opt.zero_grad()
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, run.recorder.values


#: float64 rounding of another summation order (sum / count scaled at the step, against loss / count),
#: amplified by AdamW where a gradient is rounding noise (the bias before a BatchNorm: 1.7e-11 seen
#: after 12 steps, as `unison check-exact` documents). A wrong count or a missed item is off by > 1e-3.
TOL = 1e-9


def _max_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---- one process -------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_one_process_run_equals_the_plain_loop(opt_kind):
    ds = _data(45)  # odd: the last batch holds 5 items
    weights, values = run_loop(ds, bs=8, epochs=2, bn=True, opt_kind=opt_kind)
    expected = plain_loop(ds, global_bs=8, epochs=2, bn=True, opt_kind=opt_kind)
    assert _max_diff(weights, expected) < TOL
    assert len(values) == 2 and values[1][0] < values[0][0]  # an exact train loss per epoch, falling


def test_the_trained_model_pickles_whole_on_one_process(tmp_path):
    """`torch.save(model)` of the whole module, as tutorials save it: nothing of unison's stays on it."""
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        for _ in run.epochs(1):
            model.train()
            for x, y in run.loader(DataLoader(_data(16), batch_size=8)):
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert _max_diff(loaded.state_dict(), model.state_dict()) == 0.0


def test_accumulation_and_token_counts_on_one_process():
    ds = _data(45, tokens=True)
    weights, _ = run_loop(ds, bs=4, epochs=1, bn=False, opt_kind="adamw", accumulate=3)
    expected = plain_loop(ds, global_bs=4, epochs=1, bn=False, opt_kind="adamw", accumulate=3)
    assert _max_diff(weights, expected) < TOL


def test_a_loss_already_averaged_is_refused_in_one_line():
    model = _model(False)
    with Run() as run:
        run.setup(model, _opt(model, "sgd"))
        with pytest.raises(ValueError, match=r"count=.*averaged on each rank is not exact"):
            run.loss(torch.tensor(0.5, requires_grad=True))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_per_item_losses_that_leave_out_ignored_targets_are_refused_naming_the_count(smoothing):
    """`reduction="none"` with ignore_index gives 0 for an ignored token: counted as a term, the
    step's gradient would be the mean over every token, not over the scored ones."""
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        train = run.loader(DataLoader(_data(8, tokens=True), batch_size=8))
        for _ in run.epochs(1):
            for x, y in train:
                per_item = F.cross_entropy(
                    model(x), y, ignore_index=IGNORE, reduction="none", label_smoothing=smoothing
                )
                with pytest.raises(ValueError) as caught:
                    run.loss(per_item.view(-1, 1))
                run.loss(per_item.sum(), count=int((y != IGNORE).sum()))  # what it says instead
    said = str(caught.value)
    assert said.startswith(f"Run.loss: these per-item losses leave out {int((y == IGNORE).sum())} ignored")
    assert "count=(labels != -100).sum()" in said and "\n" not in said


def test_per_item_losses_weighted_by_class_are_refused_naming_the_weights_as_the_count():
    """Each item weighs its target's class weight: one process's weighted mean divides by those."""
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        for _ in run.epochs(1):
            for x, y in run.loader(DataLoader(_data(8), batch_size=8)):
                weight = torch.tensor([1.0, 3.0], dtype=torch.float64)
                with pytest.raises(
                    ValueError, match=r"weighted by their targets' class weights.*count=weight\[labels\]"
                ):
                    run.loss(F.cross_entropy(model(x), y, weight=weight, reduction="none"))
                run.loss(F.cross_entropy(model(x), y, weight=weight, reduction="sum"), count=weight[y].sum())


def test_what_run_cannot_do_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"fault_tolerant=True\) does not support accumulate=2"):
        Run(fault_tolerant=True, accumulate=2)  # (the rest: tests/distributed/test_fault_tolerant_run.py)
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        Run(accumulate=0)
    with pytest.raises(RuntimeError, match=r"call run.setup\(model, opt\) first"):
        Run().loader(DataLoader(range(4), batch_size=2))


@pytest.mark.parametrize(
    ("callback", "instead"),
    [
        (lambda: unison.GradientAccumulation(16), r"Run\(accumulate=k\)"),
        (lambda: unison.OneCycleScheduler(1e-2), r"run.setup\(model, opt, scheduler\)"),
        (lambda: unison.SaveModelCallback(), r"run.checkpoint"),
    ],
)
def test_a_learner_callback_that_would_train_another_loop_is_refused(callback, instead):
    # GradientAccumulation on Run trained neither as Run(accumulate=2) nor as no accumulation (the
    # steps it cancelled lost their gradients at opt.zero_grad()); the others need the Learner's calls.
    run = Run()
    with pytest.raises(ValueError, match=r"^Run.add_cb\(\w+\): .*" + instead):
        run.add_cb(callback())
    assert not any(isinstance(cb, type(callback())) for cb in run.host.cbs)


def test_a_nonfinite_loss_stops_naming_it():
    ds = _data(32)
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        train = run.loader(DataLoader(ds, batch_size=8))
        with pytest.raises(NonFiniteError, match="step 2"):
            for _ in run.epochs(1):
                for step, (x, y) in enumerate(train):
                    loss = F.cross_entropy(model(x), y, reduction="sum")
                    if step == 2:
                        loss = loss * float("nan")
                    run.backward(run.loss(loss, count=len(y)))
                    opt.step()
                    opt.zero_grad()


def test_zero_grad_before_backward_keeps_accumulated_gradients():
    """Written `zero_grad(); backward(); step()` (the other common order), accumulation still adds up."""
    ds = _data(24)
    model = _model(False)
    with Run(accumulate=3) as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        train = run.loader(DataLoader(ds, batch_size=4))
        for _ in run.epochs(1):
            model.train()
            for x, y in train:
                opt.zero_grad()
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
        got = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    expected = plain_loop(ds, global_bs=4, epochs=1, bn=False, opt_kind="sgd", accumulate=3)
    assert _max_diff(got, expected) < TOL


def test_a_scheduler_stepped_at_every_batch_of_an_accumulated_step_is_refused():
    """Not given to run.setup, a scheduler stepped after `opt.step()` moves at every batch: twice
    as fast as the plain loop's with accumulate=2. Given to it, it steps at real steps only."""
    model = _model(False)
    with Run(accumulate=2) as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        train = run.loader(DataLoader(_data(16), batch_size=4))
        with pytest.raises(RuntimeError) as caught:
            for _ in run.epochs(1):
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
    said = str(caught.value)
    assert said.startswith("Run.backward: the learning rate moved from 0.1 to 0.05 (a scheduler stepped at")
    assert "no optimizer step" in said and "run.setup(model, opt, scheduler)" in said and "\n" not in said


def _averaged(guarded: bool, fail_at=None):
    """An EMA of the weights (torch's AveragedModel, registered for checkpointing) updated after
    `opt.step()`: at real steps only (`if run.sync_gradients`), or at every batch."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _model(False)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    with Run(accumulate=1 if fail_at else 2) as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        run.register_for_checkpointing(ema)
        if fail_at:
            run.add_cb(FailsCommitAt([fail_at]))
        train = run.loader(DataLoader(_data(24), batch_size=4))
        for _ in run.epochs(1):
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
                if run.sync_gradients or not guarded:
                    ema.update_parameters(run.model)
    return ema


@pytest.mark.parametrize("fail_at", [None, (0, 2)], ids=["accumulated", "torchft-redo"])
def test_an_averaged_model_updated_in_a_pass_without_a_step_is_refused(fail_at):
    with pytest.raises(
        RuntimeError, match=r"^Run.backward: the registered AveragedModel:0 was updated after a"
    ):
        _averaged(guarded=False, fail_at=fail_at)
    steps = 3 if fail_at is None else 6
    assert int(_averaged(guarded=True, fail_at=fail_at).n_averaged) == steps


def _clipped(guarded: bool):
    """Run(accumulate=2) with torch's clip_grad_norm_ after run.backward: at real steps only
    (`if run.sync_gradients`), or at every batch, where a micro-batch's gradient is the step's
    partial sum and clipping it trains another model than the plain loop."""
    ds = _data(24)
    model = _model(False)
    with Run(accumulate=2) as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        train = run.loader(DataLoader(ds, batch_size=4))
        for _ in run.epochs(1):
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                if run.sync_gradients or not guarded:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                opt.zero_grad()
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def test_a_gradient_changed_between_accumulated_batches_is_refused_and_changed_at_real_steps_is_exact():
    with pytest.raises(RuntimeError) as caught:
        _clipped(guarded=False)
    said = str(caught.value)
    assert said.startswith("Run.backward: the gradient was changed in place (clip_grad_norm_ at every batch")
    assert "run.sync_gradients" in said and "GradientClip" in said and "\n" not in said
    # The plain loop it replaced: clip once per step, on the step's whole gradient.
    ds = _data(24)
    model, (x, y) = _model(False), ds.tensors
    opt = _opt(model, "sgd")
    for first in range(0, 24, 8):
        for b in (first, first + 4):
            (F.cross_entropy(model(x[b : b + 4]), y[b : b + 4], reduction="sum") / 8).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    assert _max_diff(_clipped(guarded=True), model.state_dict()) < TOL


class FailsCommitAt(unison.Callback):
    """The own loop's side of a torchft redo, in one process: at the given (epoch, step)s the step's
    commit "fails" once, as `FaultTolerantTrainer.after_backward` makes it fail (gradients dropped,
    `redo_step` set); counts the step and batch events the loop fires."""

    order = -30

    def __init__(self, at):
        self.at, self.failed, self.events = set(at), set(), {"before_step": 0, "after_batch": 0}

    def after_backward(self):
        where = (self.learn.epoch, self.learn.iter)
        if where in self.at and where not in self.failed:
            self.failed.add(where)
            self.learn.opt.zero_grad(set_to_none=True)
            self.learn.redo_step = True

    def before_step(self):
        self.events["before_step"] += 1

    def after_batch(self):
        self.events["after_batch"] += 1


@pytest.mark.parametrize("zero_first", [False, True], ids=["step-then-zero_grad", "zero_grad-first"])
def test_a_step_whose_commit_failed_runs_the_loop_body_again_and_is_taken_once(zero_first):
    ds = _data(45)  # 6 steps of 8 an epoch, the last of 5
    model = _model(False)
    failing = FailsCommitAt([(0, 0), (0, 3), (1, 5)])
    bodies, redoing = [], []
    with Run() as run:
        run.add_cb(failing)
        model, opt = run.setup(model, _opt(model, "adamw"))
        train = run.loader(DataLoader(ds, batch_size=8))
        for epoch in run.epochs(2):
            model.train()
            for x, y in train:
                bodies.append((epoch, run.batch, len(y)))
                if zero_first:
                    opt.zero_grad()
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                if run.redoing:
                    redoing.append((epoch, run.batch))
                opt.step()
                if not zero_first:
                    opt.zero_grad()
        got = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    assert redoing == [(0, 0), (0, 3), (1, 5)]
    # the failed steps' bodies ran twice, over the same items; every step is taken and recorded once
    twice = [(0, 0, 8), (0, 0, 8), (0, 3, 8), (0, 3, 8), (1, 5, 5), (1, 5, 5)]
    assert [b for b in bodies if b[:2] in failing.at] == twice
    assert failing.events == {"before_step": 12, "after_batch": 12} and len(bodies) == 15
    expected = plain_loop(ds, global_bs=8, epochs=2, bn=False, opt_kind="adamw")
    assert _max_diff(got, expected) < TOL


# ---- W processes (the shared gloo pools) --------------------------------------------------------
def _parity(bn, opt_kind, accumulate, tokens, n):
    world = dist.get_world_size()
    ds = _data(n, tokens=tokens)
    weights, values = run_loop(ds, bs=4, epochs=2, bn=bn, opt_kind=opt_kind, accumulate=accumulate)
    expected = plain_loop(ds, global_bs=4 * world, epochs=2, bn=bn, opt_kind=opt_kind, accumulate=accumulate)
    return _max_diff(weights, expected), values


@pytest.mark.parametrize(
    "bn, opt_kind, accumulate, tokens, n",
    [
        (True, "adamw", 1, False, 48),  # BatchNorm through unison's exact sync BN
        (True, "sgd", 2, False, 45),  # accumulation, an odd N (the last global batch split 3/2)
        (False, "adamw", 2, True, 45),  # a loss counted over tokens, uneven over ranks and batches
    ],
)
def test_two_processes_equal_the_plain_one_process_loop(pool2, bn, opt_kind, accumulate, tokens, n):
    results = pool2.run(_parity, bn, opt_kind, accumulate, tokens, n)
    for diff, _ in results:
        assert diff < TOL
    train_losses = [[row[0] for row in values] for _, values in results]
    assert train_losses[0] == train_losses[1]  # the same exact epoch losses on every rank


def _bypassing(how):
    """A loop that calls the model it gave run.setup ("given"), or unfreezes a layer after
    run.setup ("unfrozen"): the wrapper it returned averages the gradients of neither."""
    given = _model(False)
    given[0].requires_grad_(how == "given")
    with Run() as run:
        model, opt = run.setup(given, torch.optim.SGD(given.parameters(), lr=0.1))
        train = run.loader(DataLoader(_data(32), batch_size=4))
        try:
            for epoch in run.epochs(2):
                given[0].requires_grad_(epoch == 1 or how == "given")
                call = given if how == "given" else model
                call.train()
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(call(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    opt.zero_grad()
        except (RuntimeError, ValueError) as exc:
            return str(exc)


def _evaluated_between_forward_and_backward():
    """A loop that evaluates between a training batch's forward pass and its backward (its own
    estimate_loss): the wrapper computed the training loss, and the evaluation leaves that so."""
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        train, valid = (
            run.loader(DataLoader(_data(16), batch_size=4)),
            run.loader(DataLoader(_data(8), batch_size=4)),
        )
        for _ in run.epochs(1):
            for x, y in train:
                model.train()
                loss = run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y))
                model.eval()
                with torch.no_grad():
                    for xv, _ in valid:
                        model(xv)
                model.train()
                run.backward(loss)
                opt.step()
                opt.zero_grad()
        return run.host.iter


def test_an_evaluation_between_a_batchs_forward_and_backward_is_not_taken_for_another_model(pool2):
    assert pool2.run(_evaluated_between_forward_and_backward) == [1, 1]


@pytest.mark.parametrize(
    "how, refusal",
    [
        ("given", "Run.backward: this batch's loss was not computed by the model run.setup returned: "),
        ("unfrozen", "the parameters that require a gradient changed since ddp wrapped the model (a layer "
         "frozen or unfrozen after run.setup): set requires_grad before it"),
    ],
)  # fmt: skip
def test_a_model_the_wrapper_run_setup_returned_does_not_average_is_refused(pool2, how, refusal):
    """Only the returned wrapper's forward pass makes DDP average the gradients, and only of the
    parameters that required one when run.setup wrapped them: each rank trained on its own gradient
    (ranks 0.03 apart)."""
    for message in pool2.run(_bypassing, how):
        assert message.startswith(refusal), message


def _scheduled(kind, counted):
    """nanoGPT's per-process batch (the global 8 over W) and a scheduler whose length counts the
    DataLoader's batches ("loader": the W-times-too-long schedule) or the run's steps ("steps")."""
    from transformers import get_linear_schedule_with_warmup

    world = dist.get_world_size()
    model = _model(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(_data(30), batch_size=8 // world)
    epochs, steps = 2, math.ceil(30 / 8)
    total = epochs * (len(dl) if counted == "loader" else steps)
    lr = torch.optim.lr_scheduler
    sched = {
        "OneCycleLR": lambda: lr.OneCycleLR(opt, max_lr=0.1, total_steps=total),
        "CosineAnnealingLR": lambda: lr.CosineAnnealingLR(opt, T_max=total),
        "transformers": lambda: get_linear_schedule_with_warmup(opt, 2, num_training_steps=total),
    }[kind]()
    with Run() as run:
        model, opt, sched = run.setup(model, opt, sched)
        train = run.loader(dl)
        try:
            for _ in run.epochs(epochs):
                model.train()
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        except ValueError as exc:
            return str(exc)
        return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("kind", ["OneCycleLR", "CosineAnnealingLR", "transformers"])
def test_a_schedule_counting_the_dataloaders_batches_is_refused_naming_the_runs_steps(pool2, kind):
    """On W processes each rank takes 1/W of the DataLoader's batches: a schedule as long as
    `len(dl)` epochs would stop part way, where the same script on one process ends it."""
    name = {"OneCycleLR": "total_steps", "CosineAnnealingLR": "T_max"}.get(kind, "num_training_steps")
    for message in pool2.run(_scheduled, kind, "loader"):
        assert message.startswith(f"run.epochs(2): the LR scheduler's {name}=16 counts the "), message
        assert f"{name}=8 " in message
    steps_lr = pool2.run(_scheduled, kind, "steps")
    assert steps_lr[0] == steps_lr[1] and not isinstance(steps_lr[0], str)


def _averaging_the_wrapper():
    """An EMA built on the model run.setup returned, as after Accelerate's prepare."""
    model = _model(False)
    with Run() as run:
        model, _ = run.setup(model, _opt(model, "sgd"))
        try:
            run.register_for_checkpointing(torch.optim.swa_utils.AveragedModel(model))
        except TypeError as exc:
            return str(exc)


def test_an_averaged_model_of_the_ddp_wrapper_is_refused_naming_run_model(pool2):
    """Its checkpoint's keys carry DDP's `module.` prefix: a resume at another number of processes
    failed on them (missing keys `module.0.weight`)."""
    for message in pool2.run(_averaging_the_wrapper):
        assert message.startswith("Run.register_for_checkpointing: the AveragedModel averages the "), message
        assert "AveragedModel(run.model)" in message


def _evaluate(n, bs):
    """Accelerate's no_trainer evaluation shape: the metric over gathered predictions."""
    ds = _data(n)
    model = _model(False)
    with Run() as run:
        model, _ = run.setup(model, _opt(model, "sgd"))
        valid = run.loader(DataLoader(ds, batch_size=bs), train=False)
        model.eval()
        preds, labels = [], []
        with torch.no_grad():
            for x, y in valid:
                p, t = run.gather((model(x).argmax(1), y))
                preds.append(p)
                labels.append(t)
        return torch.cat(preds), torch.cat(labels)


def test_gather_gives_every_item_once_in_data_order(pool2):
    n, bs = 1001, 16
    results = pool2.run(_evaluate, n, bs)
    model = _model(False).eval()
    x, y = _data(n).tensors
    with torch.no_grad():
        expected = model(x).argmax(1)
    for preds, labels in results:
        assert torch.equal(labels, y) and torch.equal(preds, expected)
    accuracy = float((results[0][0] == y).float().mean())
    assert accuracy == float((expected == y).float().mean())


def _generated(pad_value):
    """Each item "generates" as many tokens as its index mod 3 says (a rank's batch padded with -1
    to its own longest), gathered as an evaluation of generated sequences would be."""
    model = _model(False)
    with Run() as run:
        run.setup(model).eval()
        valid = run.loader(DataLoader(TensorDataset(torch.arange(10)), batch_size=2), train=False)
        gathered = []
        try:
            for (i,) in valid:
                longest = int((i % 3).max()) + 1
                tokens = torch.stack(
                    [torch.arange(longest).where(torch.arange(longest) <= k % 3, -1) for k in i]
                )
                gathered.append(
                    run.gather(tokens, pad_value=pad_value) if pad_value is not None else run.gather(tokens)
                )
        except ValueError as exc:
            return str(exc)
        return gathered


def test_gather_of_a_0_dim_tensor_is_refused_naming_per_item_values():
    """Accelerate's `gather(loss)` of a batch's mean, ported: one value per rank is not items."""
    model = _model(False)
    with Run() as run:
        run.setup(model)
        with pytest.raises(ValueError, match=r"^run.gather: a 0-dim tensor has no rows .*reduction=\"none\""):
            run.gather({"loss": torch.tensor(0.5), "preds": torch.zeros(3)})


def test_gather_refuses_rows_of_different_sizes_unless_told_what_fills_them(pool2):
    """Padding the shorter rows with 0 would be a token; the one-process batch is padded with the
    value the user pads with."""
    for said in pool2.run(_generated, None):
        assert isinstance(said, str) and said.startswith("run.gather: the ranks' rows differ in size"), said
        assert "pad_value=" in said and "\n" not in said
    for gathered in pool2.run(_generated, -1):  # the global batch of 4, padded as one process pads it
        for b, tokens in enumerate(gathered):
            items = range(4 * b, min(4 * b + 4, 10))
            longest = max(k % 3 for k in items) + 1
            want = torch.stack(
                [torch.arange(longest).where(torch.arange(longest) <= k % 3, -1) for k in items]
            )
            assert torch.equal(tokens, want)


class _PythonRandomSampler(Sampler):
    """Shuffles with Python's `random`, which nothing seeds alike on every rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        import random

        order = list(range(self.n))
        random.Random().shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


def _unseeded_sampler():
    model = _model(False)
    with Run() as run:
        run.setup(model, _opt(model, "sgd"))
        try:
            run.loader(DataLoader(_data(64), batch_size=4, sampler=_PythonRandomSampler(64)))
        except ValueError as exc:
            return str(exc)
    return None


def test_a_sampler_unison_cannot_seed_is_refused_in_one_line(pool2):
    for message in pool2.run(_unseeded_sampler):
        assert message is not None and "torch.Generator" in message and "\n" not in message


def _nan_on_rank_1():
    ds = _data(32)
    model = _model(False)
    with Run() as run:
        model, opt = run.setup(model, _opt(model, "sgd"))
        train = run.loader(DataLoader(ds, batch_size=4))
        try:
            for _ in run.epochs(1):
                for step, (x, y) in enumerate(train):
                    loss = F.cross_entropy(model(x), y, reduction="sum")
                    if step == 1 and run.rank == 1:
                        loss = loss * float("inf")
                    run.backward(run.loss(loss, count=len(y)))
                    opt.step()
                    opt.zero_grad()
        except NonFiniteError as exc:
            return str(exc)
    return None


def test_a_nonfinite_loss_on_one_rank_stops_every_rank_naming_it(pool2):
    messages = pool2.run(_nan_on_rank_1)
    for message in messages:
        assert message is not None and "step 1" in message and "rank 1" in message


def _plateau(shared: bool):
    """A ReduceLROnPlateau given to run.setup, stepped on each epoch's validation loss: this rank's
    own (a per-rank learning rate: refused) or the mean over `run.gather` (every rank's alike)."""
    train_ds, valid_ds = _data(32), _data(24, seed=2)
    model = _model(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5)
    lrs = []
    with Run() as run:
        model, opt, sched = run.setup(model, opt, sched)
        train, valid = (
            run.loader(DataLoader(train_ds, batch_size=4)),
            run.loader(DataLoader(valid_ds, batch_size=4)),
        )
        try:
            for _ in run.epochs(3):
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    opt.zero_grad()
                with torch.no_grad():
                    losses = [F.cross_entropy(model(x), y, reduction="none") for x, y in valid]
                    if shared:
                        sched.step(float(torch.cat([run.gather(t) for t in losses]).mean()))
                    else:
                        sched.step(float(torch.cat(losses).mean()))
                lrs.append(opt.param_groups[0]["lr"])
        except ValueError as exc:
            return str(exc)
    return lrs, {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def test_a_plateau_scheduler_stepped_on_a_value_each_rank_computed_alone_is_refused(pool2):
    """Each rank would set its own learning rate and the replicas drift apart, silently."""
    for message in pool2.run(_plateau, False):
        assert isinstance(message, str) and message.startswith("sched.step("), message
        assert "each rank would set its own learning rate" in message and "run.gather" in message
        assert "\n" not in message
    (lrs, weights), (lrs1, weights1) = pool2.run(_plateau, True)  # the shared value: one schedule
    assert lrs == lrs1 and lrs[-1] < 0.5
    assert all(torch.equal(weights[k], weights1[k]) for k in weights)


def test_the_package_exports_run():
    assert unison.Run is Run


def _sharded(tmp, opt_kind):
    """Run(shard=True): FSDP2 on every rank; the user's model gets the trained weights back at the end."""
    world = dist.get_world_size()
    ds = _data(48)
    original = _model(bn=False)
    with Run(shard=True, path=tmp) as run:
        model, opt = run.setup(original, _opt(original, opt_kind))
        train = run.loader(DataLoader(ds, batch_size=4))
        saved = run.checkpoint()
        for _ in run.epochs(2):
            model.train()
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
        fmt = run.host.checkpoint_format
    weights = {k: v.detach().clone() for k, v in original.state_dict().items()}
    expected = plain_loop(ds, global_bs=4 * world, epochs=2, bn=False, opt_kind=opt_kind)
    dcp = saved.with_suffix(".dcp")
    return _max_diff(weights, expected), fmt, dcp.is_dir() and (dcp / ".metadata").exists()


@pytest.mark.parametrize("opt_kind", ["adamw", "adamw-groups"])
def test_run_shard_true_trains_fsdp2_to_the_plain_loops_weights_with_dcp_checkpoints(
    pool2, tmp_path, opt_kind
):
    """With the optimizer's own param groups too (they were rebuilt as one group of the defaults)."""
    for diff, fmt, dcp_written in pool2.run(_sharded, str(tmp_path), opt_kind):
        assert fmt == "dcp" and dcp_written
        assert diff < TOL

"""What `unison.Run` carries besides model and optimizer (issue 48): an LR scheduler given to
`run.setup`, stepped at real optimizer steps only, checkpointed and restored with the optimizer's
hyper-parameters intact; any object registered for checkpointing; a scheduler unison was not given
refused at the first checkpoint; misuse of the API refused before a step. Each against a plain
single-process loop written here (AdamW, OneCycleLR)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.test_run import _data, _model
from unison import Run

STEPS_PER_EPOCH = 6  # 45 items in batches of 4 (12 batches, the last of 1), 2 batches a step
EPOCHS = 3


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _sched(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS_PER_EPOCH * EPOCHS)


def plain_loop(ds, bs=4, accumulate=2, epochs=EPOCHS):
    """No unison: `accumulate` consecutive batches a step, the scheduler stepped after each step."""
    model = _model(False)
    opt = _opt(model)
    sched = _sched(opt)
    x, y = ds.tensors
    n_batches = math.ceil(len(ds) / bs)
    lrs = []
    for _ in range(epochs):
        for first in range(0, n_batches, accumulate):
            batches = range(first, min(first + accumulate, n_batches))
            count = sum(len(y[b * bs : (b + 1) * bs]) for b in batches)
            for b in batches:
                xb, yb = x[b * bs : (b + 1) * bs], y[b * bs : (b + 1) * bs]
                (F.cross_entropy(model(xb), yb, reduction="sum") / count).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs


class Crash(Exception):
    pass


def run_loop(ds, path, crash_at=None, resume=False, every=2, epochs=EPOCHS):
    model = _model(False)
    opt = _opt(model)
    lrs = []
    with Run(accumulate=2, path=path) as run:
        model, opt, sched = run.setup(model, opt, _sched(opt))
        train = run.loader(DataLoader(ds, batch_size=4))
        run.checkpoint(every=every)
        for epoch in run.epochs(epochs, resume=resume):
            model.train()
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
                sched.step()  # called every batch: it steps at real optimizer steps only
                if run.sync_gradients:
                    lrs.append(opt.param_groups[0]["lr"])
                if (epoch, run.batch) == crash_at:
                    raise Crash()
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, lrs


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a), max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_scheduler_given_to_setup_steps_at_real_steps_only(tmp_path):
    ds = _data(45)
    expected, expected_lrs = plain_loop(ds)
    got, lrs = run_loop(ds, tmp_path)
    assert lrs == expected_lrs
    assert _equal(got, expected)[1] < 1e-9


def test_a_scheduler_given_to_setup_resumes_mid_epoch_to_the_uninterrupted_weights(tmp_path):
    ds = _data(45)
    whole, whole_lrs = run_loop(ds, tmp_path / "whole")
    with pytest.raises(Crash):
        run_loop(ds, tmp_path / "cut", crash_at=(1, 6))  # checkpointed after batch 5 (every=2), then dies
    resumed, resumed_lrs = run_loop(ds, tmp_path / "cut", resume=True)
    same, diff = _equal(resumed, whole)
    assert same, diff
    assert resumed_lrs == whole_lrs[-len(resumed_lrs) :]


def _train(run, model, opt, train, steps=None, sched=None, body=None):
    """The usual body; `body(x, y)` replaces the loss and backward when given."""
    for _ in run.epochs(1):
        model.train()
        for i, (x, y) in enumerate(train):
            if body is not None:
                body(x, y)
            else:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            if steps is not None and i + 1 == steps:
                break


def test_a_scheduler_unison_was_not_given_is_refused_at_the_first_checkpoint(tmp_path):
    model = _model(False)
    with Run(path=tmp_path) as run:
        raw = _opt(model)
        sched = _sched(raw)  # stepped below, never handed to unison
        model, opt = run.setup(model, raw)
        train = run.loader(DataLoader(_data(45), batch_size=4))
        run.checkpoint(every=2)
        with pytest.raises(
            ValueError,
            match=r"^Run.checkpoint: an LR scheduler unison was not given.*run.setup\(model, opt, sched",
        ):
            _train(run, model, opt, train, sched=sched)
        assert not (tmp_path / "models" / "checkpoint.pth").exists()


def test_a_learning_rate_set_by_the_loop_itself_is_not_refused(tmp_path):
    """nanoGPT's `get_lr(step)`: a function of the step, resumed as it is."""
    model = _model(False)
    with Run(path=tmp_path) as run:
        model, opt = run.setup(model, _opt(model))
        train = run.loader(DataLoader(_data(16), batch_size=4))
        run.checkpoint(every=2)

        def body(x, y):
            for group in opt.param_groups:
                group["lr"] = 0.01 * (run.batch + 1)
            run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))

        _train(run, model, opt, train, body=body)
    assert (tmp_path / "models" / "checkpoint.pth").exists()


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_registered_object_is_checkpointed_and_restored(tmp_path):
    def go(crash, resume):
        model = _model(False)
        counter = Counter()
        with Run(path=tmp_path) as run:
            model, opt = run.setup(model, _opt(model))
            run.register_for_checkpointing(counter)
            train = run.loader(DataLoader(_data(16), batch_size=4))
            run.checkpoint(every=1)
            for _ in run.epochs(2, resume=resume):
                model.train()
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    opt.zero_grad()
                    counter.n += run.sync_gradients
                    if crash and counter.n == 6:
                        raise Crash()
        return counter.n

    with pytest.raises(Crash):
        go(crash=True, resume=False)
    assert go(crash=False, resume=True) == 8
    with pytest.raises(TypeError, match="has no state_dict or load_state_dict"):
        Run().register_for_checkpointing(object())


def test_a_checkpoint_missing_a_component_is_refused_in_one_line(tmp_path):
    model = _model(False)
    with Run(path=tmp_path) as run:
        model, opt = run.setup(model, _opt(model))
        train = run.loader(DataLoader(_data(16), batch_size=4))
        run.checkpoint()
        _train(run, model, opt, train)
    from unison import CheckpointError

    model = _model(False)
    with Run(path=tmp_path) as run:
        raw = _opt(model)
        model, opt, sched = run.setup(model, raw, _sched(raw))
        run.loader(DataLoader(_data(16), batch_size=4))
        with pytest.raises(
            CheckpointError,
            match=r"holds the components \['data_order'\], this run hands \['data_order', 'scheduler'\]",
        ):
            list(run.epochs(2, resume=True))


# ---- misuse, refused before a step (issue 48.4) --------------------------------------------------
def _misuse(body, accumulate=1, raw_loader=False):
    model = _model(False)
    with Run(accumulate=accumulate) as run:
        model, opt = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = {k: v.clone() for k, v in run.model.state_dict().items()}
        dl = DataLoader(_data(16), batch_size=4)
        train = run.loader(dl)
        try:
            _train(run, model, opt, dl if raw_loader else train, body=lambda x, y: body(run, model, x, y))
        finally:
            after = run.model.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)  # no step was taken


def test_a_loss_from_run_loss_backpropagated_without_run_backward_is_refused():
    def body(run, model, x, y):
        run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)).backward()

    with pytest.raises(RuntimeError, match=r"backpropagated with \.backward\(\).*run\.backward\(loss\)"):
        _misuse(body)


def test_run_backward_of_a_tensor_not_from_run_loss_is_refused():
    def body(run, model, x, y):
        run.backward(F.cross_entropy(model(x), y))

    with pytest.raises(RuntimeError, match=r"Run.backward: give it what run.loss returned"):
        _misuse(body)


@pytest.mark.parametrize("change", ["GradScaler", "divided"])
def test_a_loss_scaled_or_divided_after_run_loss_is_refused_naming_why(change):
    """An AMP loop's `scaler.scale(loss)`, or Accelerate's `loss / accumulation_steps`, ported as is."""
    scaler = torch.amp.GradScaler("cpu")

    def body(run, model, x, y):
        loss = run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y))
        run.backward(scaler.scale(loss) if change == "GradScaler" else loss / 2)

    with pytest.raises(RuntimeError, match=r"unchanged: .*it was changed after run.loss: .*MixedPrecision\("):
        _misuse(body)


def test_a_training_pass_over_a_raw_dataloader_is_refused_naming_run_loader():
    def body(run, model, x, y):
        run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))

    with pytest.raises(RuntimeError, match=r"not in a pass over run.loader\(dl\).*iterate what run.loader"):
        _misuse(body, raw_loader=True)


def test_a_checkpoint_interval_not_a_multiple_of_accumulate_is_refused():
    model = _model(False)
    with Run(accumulate=2) as run:
        run.setup(model, _opt(model))
        with pytest.raises(ValueError, match=r"every=3.*accumulate=2.*a multiple of 2"):
            run.checkpoint(every=3)


def test_evaluation_alone_needs_no_optimizer():
    model = _model(False)
    ds = _data(10)
    with Run() as run:
        model = run.setup(model)
        valid = run.loader(DataLoader(ds, batch_size=4), train=False)
        model.eval()
        with torch.no_grad():
            preds = torch.cat([run.gather(model(x)) for x, _ in valid])
        assert torch.allclose(preds, _model(False)(ds.tensors[0]), rtol=0, atol=1e-12)
        model.train()
        with pytest.raises(
            RuntimeError, match=r"a training pass needs an optimizer: run.setup\(model, opt\)"
        ):
            next(iter(valid))


def test_a_preempted_run_names_run_epochs_resume_in_its_message(tmp_path):
    import os
    import signal

    from unison.callbacks.preemption import Preempted

    model = _model(False)
    with Run(path=tmp_path) as run:
        model, opt = run.setup(model, _opt(model))
        train = run.loader(DataLoader(_data(16), batch_size=4))
        run.checkpoint()
        with pytest.raises(Preempted) as stop:
            for _ in run.epochs(2):
                model.train()
                for x, y in train:
                    run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                    opt.step()
                    opt.zero_grad()
                    if run.batch == 1:
                        os.kill(os.getpid(), signal.SIGTERM)
    assert "resubmit with run.epochs(n, resume=True)" in str(stop.value), str(stop.value)


# ---- the order comes from the user's DataLoader (issue 48.5) ------------------------------------
def _shuffled(ds, bs, generator):
    g = torch.Generator().manual_seed(3) if generator else None
    return DataLoader(ds, batch_size=bs, shuffle=True, generator=g)


def plain_shuffled(ds, global_bs, epochs, generator):
    """The plain loop over a shuffled DataLoader (seeded generator, or the global one after
    torch.manual_seed(5)): the batches it sees and its weights."""
    model = _model(False)
    opt = _opt(model)
    torch.manual_seed(5)
    dl = _shuffled(ds, global_bs, generator)
    seen = []
    for _ in range(epochs):
        for x, y in dl:
            seen.append(x)
            (F.cross_entropy(model(x), y, reduction="sum") / len(y)).backward()
            opt.step()
            opt.zero_grad()
    return torch.cat(seen), {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_shuffled(ds, bs, epochs, generator):
    model = _model(False)
    seen = []
    with Run() as run:
        model, opt = run.setup(model, _opt(model))
        torch.manual_seed(5)
        train = run.loader(_shuffled(ds, bs, generator))
        for _ in run.epochs(epochs):
            model.train()
            for x, y in train:
                seen.append(run.gather(x))
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
        return torch.cat(seen), {k: v.detach().clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("generator", [True, False], ids=["dataloader-generator", "global-generator"])
def test_one_process_trains_on_the_plain_loops_batches(generator):
    ds = _data(45)
    want_seen, want = plain_shuffled(ds, 8, 3, generator)
    seen, got = run_shuffled(ds, 8, 3, generator)
    assert torch.equal(seen, want_seen)  # the very batches, in the very order, every epoch
    assert _equal(got, want)[1] < 1e-9


def _shuffled_parity(generator):
    world = torch.distributed.get_world_size()
    ds = _data(45)
    want_seen, want = plain_shuffled(ds, 4 * world, 2, generator)
    seen, got = run_shuffled(ds, 4, 2, generator)
    return torch.equal(seen, want_seen), _equal(got, want)[1]


@pytest.mark.parametrize("generator", [True, False], ids=["dataloader-generator", "global-generator"])
def test_w_processes_follow_the_plain_loops_global_order(pool2, pool3, generator):
    for pool in (pool2, pool3):
        for same_batches, diff in pool.run(_shuffled_parity, generator):
            assert same_batches and diff < 1e-9


def test_mixed_precision_bf16_trains_as_a_plain_autocast_loop():
    from unison import MixedPrecision

    ds = _data(32)
    x, y = ds.tensors[0].float(), ds.tensors[1]

    def make():
        model = _model(False).float()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = make()
    for b in range(0, 32, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[b : b + 8]), y[b : b + 8], reduction="sum")
        (loss / 8).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, opt = make()
    with Run() as run:
        run.add_cb(MixedPrecision("bf16"))
        model, opt = run.setup(model, opt)
        train = run.loader(DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
        for _ in run.epochs(1):
            model.train()
            for xb, yb in train:
                out = model(xb)
                assert out.dtype == torch.bfloat16  # under autocast
                run.backward(run.loss(F.cross_entropy(out, yb, reduction="sum"), count=len(yb)))
                opt.step()
                opt.zero_grad()
        got = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    assert _equal(got, want)[1] < 1e-5


def _sharded_with_scheduler(tmp):
    """Run(shard=True) rebuilds the optimizer over the shards: the scheduler drives the rebuilt one."""
    import warnings

    world = torch.distributed.get_world_size()
    ds = _data(45)
    original = _model(False)
    raw = _opt(original)
    with warnings.catch_warnings(record=True) as caught, Run(shard=True, accumulate=2, path=tmp) as run:
        warnings.simplefilter("always")
        model, opt, sched = run.setup(original, raw, _sched(raw))
        train = run.loader(DataLoader(ds, batch_size=4 // world))
        run.checkpoint()
        for _ in run.epochs(EPOCHS):
            model.train()
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
                sched.step()
    weights = {k: v.detach().clone() for k, v in original.state_dict().items()}
    expected, _ = plain_loop(ds)
    lr_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return _equal(weights, expected)[1], lr_warnings


def test_a_scheduler_drives_the_optimizer_fsdp2_rebuilds(pool2, tmp_path):
    for diff, lr_warnings in pool2.run(_sharded_with_scheduler, str(tmp_path)):
        assert diff < 1e-9 and lr_warnings == []


def _callback_loop(ds, path, crash_at=None, resume=False):
    """The same training with the Learner's LRSchedulerCallback added to Run (stepped at after_step)."""
    from unison import LRSchedulerCallback

    model = _model(False)
    with Run(accumulate=2, path=path) as run:
        run.add_cb(LRSchedulerCallback(_sched))
        model, opt = run.setup(model, _opt(model))
        train = run.loader(DataLoader(ds, batch_size=4))
        run.checkpoint(every=2)
        for epoch in run.epochs(EPOCHS, resume=resume):
            model.train()
            for x, y in train:
                run.backward(run.loss(F.cross_entropy(model(x), y, reduction="sum"), count=len(y)))
                opt.step()
                opt.zero_grad()
                if (epoch, run.batch) == crash_at:
                    raise Crash()
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def test_lr_scheduler_callback_on_run_resumes_to_the_uninterrupted_weights(tmp_path):
    ds = _data(45)
    whole = _callback_loop(ds, tmp_path / "whole")
    assert _equal(whole, plain_loop(ds)[0])[1] < 1e-9
    with pytest.raises(Crash):
        _callback_loop(ds, tmp_path / "cut", crash_at=(1, 6))
    same, diff = _equal(_callback_loop(ds, tmp_path / "cut", resume=True), whole)
    assert same, diff

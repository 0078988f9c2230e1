import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Callback, DataLoaders, Learner, MixedPrecision, set_seed


class Spy(Callback):
    order = 50

    def __init__(self):
        self.pred_dtypes, self.grad_dtypes = set(), set()

    def after_pred(self):
        self.pred_dtypes.add(self.learn.pred.dtype)

    def after_backward(self):
        self.grad_dtypes.update(p.grad.dtype for p in self.learn.model.parameters())


def _learner(cbs, batchnorm=True):
    set_seed(0)
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
        DataLoader(TensorDataset(x, y), batch_size=32),
    )
    norm = nn.BatchNorm1d(32) if batchnorm else nn.Identity()  # (torchft refuses BatchNorm)
    model = nn.Sequential(nn.Linear(8, 32), norm, nn.ReLU(), nn.Linear(32, 2))
    return Learner(dls, model, nn.CrossEntropyLoss(), lr=1e-2, cbs=cbs)


def test_fp16_on_cpu_is_a_clear_error_not_a_silent_no_op():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"fp16.*needs a CUDA GPU.*bf16"):
        MixedPrecision("fp16")


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        MixedPrecision("fp8")


def test_bf16_autocast_on_cpu_trains_with_float32_weights_and_grads(capsys):
    spy = Spy()
    learn = _learner([MixedPrecision("bf16"), spy])
    before = learn.validate()[0]
    learn.fit(3)
    assert spy.pred_dtypes == {torch.bfloat16}  # the forward ran in bf16
    assert spy.grad_dtypes == {torch.float32}
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert learn.validate()[0] < before and learn.scaler is None
    # outside fit, no autocast is left active
    assert learn.model(torch.randn(4, 8)).dtype == torch.float32


class VoteFailsOnce:
    """Stands in for torchft's vote (`unison.distributed.strategy.VotedSteps`) in one process: the
    vote of training step `fail_at` fails once, so the loop redoes that step on the same items, as
    it does after a replica is lost mid-step."""

    kind = "torchft"

    def __init__(self, host, fail_at):
        self.host, self.fail_at, self.step, self.failed = host, fail_at, -1, False

    def start_point(self, point):
        return point

    def step_share(self, epoch, step, xb, yb):
        self.step, self.share = step, (xb, yb, False)
        return self.share

    def commit(self):
        fails = self.step == self.fail_at and not self.failed
        self.failed |= fails
        return not fails, None, 0.0

    def retake_step(self):
        self.host.opt.zero_grad(set_to_none=True)  # as FaultTolerantTrainer.retake_step does
        return self.share


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_redone_torchft_step_runs_its_forward_under_autocast_and_ends_on_the_same_weights():
    """A step whose vote failed is redone from its forward pass: in bf16 as the step it redoes
    (not float32 outside autocast), so the run ends on the weights of a run without the failure."""
    spy = Spy()
    learn = _learner([MixedPrecision("bf16"), spy], batchnorm=False)
    learn.strategy = VoteFailsOnce(learn, fail_at=2)
    learn.fit(1)
    want = _weights(learn.model)
    assert learn.strategy.failed and spy.pred_dtypes == {torch.bfloat16}

    spy = Spy()
    learn = _learner([MixedPrecision("bf16"), spy], batchnorm=False)
    learn.fit(1)  # no vote, no failure
    assert all(torch.equal(v, want[k]) for k, v in _weights(learn.model).items())


def test_a_redone_torchft_step_of_your_own_loop_runs_its_forward_under_autocast():
    from unison import Run

    def train(fail_at):
        set_seed(0)
        x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dtypes = []
        with Run() as run:
            run.add_cb(MixedPrecision("bf16"))
            model, opt = run.setup(model, opt)
            train = run.loader(DataLoader(TensorDataset(x, y), batch_size=16))
            if fail_at is not None:
                run.host.strategy = VoteFailsOnce(run.host, fail_at)
            for _ in run.epochs(1):
                for xb, yb in train:
                    out = model(xb)
                    dtypes.append(out.dtype)
                    loss = nn.functional.cross_entropy(out, yb, reduction="sum")
                    run.backward(run.loss(loss, count=len(yb)))
                    if not run.redoing:
                        opt.step()
                    opt.zero_grad()
            return _weights(run.model), dtypes

    want, _ = train(None)
    got, dtypes = train(2)
    assert dtypes == [torch.bfloat16] * 5  # four steps, the third one twice
    assert all(torch.equal(v, want[k]) for k, v in got.items())

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


def _learner(cbs):
    set_seed(0)
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long()
    dls = DataLoaders(
        DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
        DataLoader(TensorDataset(x, y), batch_size=32),
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
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

"""How far W processes drift from one process, and why: float32 against float64.

A deep BatchNorm network (a ResNet-10 in the shape of timm's `resnet10t`: a three-conv stem and
four stages of BasicBlocks, BatchNorm after every conv) and, for contrast, a plain MLP, trained
with SGD for a few steps on 1 process (batch 2b) and on 2 processes (batch b each, exact
BatchNorm) in float32 and in float64. Reported: the largest parameter difference, the largest
BatchNorm running-mean difference, and, as the yardstick of float noise, how far one process's
own float32 gradient is from float64 at the first batch and how far one process drifts when it
only reverses the rows of its own batches (another summation order, nothing else).

    python benchmarks/float_noise.py            # about a minute on 2 CPU cores

The result is in benchmarks/RESULTS.md ("Float noise") and the README ("What is exact").
"""

from __future__ import annotations

import contextlib
import io
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison
from unison import DataLoaders, Learner, set_seed
from unison.distributed import num_distrib

STEPS, BATCH = 12, 16  # BATCH: one process's batch; each of 2 processes takes half


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out))


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c_in, c_out, stride), nn.ReLU(), conv_bn(c_out, c_out))
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else conv_bn(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet10t(classes: int = 10, width: int = 16) -> nn.Module:
    stem = [conv_bn(3, width // 2, 2), nn.ReLU(), conv_bn(width // 2, width // 2), nn.ReLU()]
    stem += [conv_bn(width // 2, width), nn.ReLU()]
    stages, c = [], width
    for i, c_out in enumerate([width, 2 * width, 4 * width, 8 * width]):
        stages.append(Block(c, c_out, 1 if i == 0 else 2))
        c = c_out
    return nn.Sequential(*stem, *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


def mlp(classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(), nn.Linear(64, classes))


MODELS = {"resnet10t (BatchNorm)": resnet10t, "mlp (no BatchNorm)": mlp}


def data(dtype: torch.dtype, reverse: bool = False) -> DataLoaders:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 3, 32, 32, generator=g).to(dtype)
    y = torch.randint(0, 10, (STEPS * BATCH,), generator=g)
    if reverse:  # the same batches, each with its rows in the opposite order
        idx = torch.arange(len(x)).view(STEPS, BATCH).flip(1).flatten()
        x, y = x[idx], y[idx]
    dl = DataLoader(TensorDataset(x, y), batch_size=BATCH // num_distrib())
    return DataLoaders(dl, None)


def train(model_name: str, dtype: torch.dtype, reverse: bool = False) -> dict[str, torch.Tensor]:
    set_seed(0)
    model = MODELS[model_name]().to(dtype)
    learn = Learner(data(dtype, reverse), model, nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.05)
    with contextlib.redirect_stdout(io.StringIO()):
        if num_distrib() > 1:
            with learn.distrib_ctx():
                learn.fit(1)
        else:
            learn.fit(1)
    return {k: v.detach().double().clone() for k, v in learn.raw_model.state_dict().items()}


def first_grad_error(model_name: str) -> float:
    """One process, one batch: |g32 - g64| / |g64| over every parameter."""
    grads = {}
    for dtype in (torch.float32, torch.float64):
        set_seed(0)
        model = MODELS[model_name]().to(dtype)
        x, y = data(dtype).train.dataset.tensors
        nn.functional.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()
        grads[dtype] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return float((grads[torch.float32] - grads[torch.float64]).norm() / grads[torch.float64].norm())


def gaps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    params = max(float((a[k] - b[k]).abs().max()) for k in a if "running" not in k and "num_batches" not in k)
    running = [float((a[k] - b[k]).abs().max()) for k in a if k.endswith("running_mean")]
    return params, max(running, default=0.0)


def two_process_run(model_name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return train(model_name, dtype)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name in MODELS:
        row = [name]
        for dtype in (torch.float32, torch.float64):
            one = train(name, dtype)
            two = unison.spawn(two_process_run, 2, args=(name, dtype))
            row += gaps(one, two)
        row.append(gaps(train(name, torch.float32), train(name, torch.float32, reverse=True))[0])
        row.append(first_grad_error(name))
        rows.append(row)
    print(f"SGD lr=0.05, {STEPS} steps, global batch {BATCH}, 2 processes vs 1, torch {torch.__version__}\n")
    print(
        "| model | float32: params | float32: BN running mean | float64: params | float64: BN running mean "
        "| float32, 1 process, rows reversed: params | float32 vs float64 gradient, first batch (relative) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, p32, r32, p64, r64, rev, g in rows:
        print(f"| {name} | {p32:.1e} | {r32:.1e} | {p64:.1e} | {r64:.1e} | {rev:.1e} | {g:.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""`ExactnessProbe`: what `unison check-exact` records from a run of the user's own script.

`unison check-exact` (see `unison.check.runs`) runs the script under `unison launch` with
`UNISON_EXACT_PROBE` naming a file. Every `Learner` the script builds then gets this callback
(`attach_if_checking`, called at the end of `Learner.__init__`), and the first `fit` of the
process (an `lr_find` sweep does not count):

- stops after `UNISON_EXACT_STEPS` optimizer steps, at a batch boundary, every rank at the same
  step; the training phase of that epoch ends there and its validation runs as usual, so the
  metrics are those of the weights after that many steps;
- then writes, from rank 0, one file (`torch.save`, loadable with `weights_only=True`): the
  model's full state (parameters and buffers; FSDP2 shards gathered), each training batch's
  loss over all ranks, the recorded epoch rows (`train_loss, valid_loss, *metrics`), the
  process count, the per-process batch size and a fingerprint of the weights the fit started
  from;
- and ends the process (`SystemExit(0)` on every rank): the rest of the script does not run.

With `UNISON_EXACT_FLOAT64=1` the model is made float64 (`model.double()`) when the `Learner`
is built, before any parallel wrapper is; every floating tensor of every batch becomes float64,
and during the fit torch's default dtype is float64 (tensors a model makes in `forward`).
Nothing changes when `UNISON_EXACT_PROBE` is unset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unison.callbacks.schedule import LRFinder
from unison.data.batch import map_tensors
from unison.env_names import FLOAT64_ENV, PROBE_ENV, STEPS_ENV
from unison.events import Callback, CancelFitException, CancelTrainException

if TYPE_CHECKING:
    from unison.learner_view import EngineHost, LearnerView

#: Version of the file's layout.
PROBE_FORMAT = 1

# The first fit of this process is the probed one, whichever Learner runs it.
_claimed: list[bool] = [False]


def attach_if_checking(learn: EngineHost) -> ExactnessProbe | None:
    """Add an `ExactnessProbe` to `learn` when `unison check-exact` runs this script; else nothing."""
    path = os.environ.get(PROBE_ENV)
    if not path:
        return None
    raw = os.environ.get(STEPS_ENV, "")
    steps = int(raw) if raw.isdigit() and int(raw) > 0 else 5
    probe = ExactnessProbe(path, steps=steps, float64=os.environ.get(FLOAT64_ENV) == "1")
    if probe.float64:
        learn.model.double()  # before DDP/FSDP wrap it: their buffers follow the parameters' dtype
    learn.add_cb(probe)
    return probe


def to_float64(obj: Any) -> Any:
    """`obj` (a tensor or any nesting of containers, each kept as its class) with floating tensors as
    float64."""
    return map_tensors(lambda t: t.double() if t.is_floating_point() else t, obj)


def _full(t: Tensor) -> Tensor:
    """A DTensor (FSDP2) gathered from its shards (every rank calls it); a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def full_state(learn: LearnerView) -> dict[str, Tensor]:
    """The model's state dict as plain CPU tensors (FSDP2 shards gathered: every rank calls it)."""
    state = learn.raw_model.state_dict().items()
    return {name: _full(value).detach().cpu().clone() for name, value in state if isinstance(value, Tensor)}


def fingerprint(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per tensor: (sum, sum of |x|, sum of x^2) in float64. Equal weights give equal bits."""
    prints = {}
    for name, t in state.items():
        x = t.double()
        prints[name] = torch.stack([x.sum(), x.abs().sum(), (x * x).sum()])
    return prints


def note_gradient_sizes(learn: LearnerView, ratios: dict[str, float]) -> None:
    """Keep in `ratios`, per parameter, the largest over steps of max|grad| / (the model's max|grad|).

    A parameter whose true gradient is zero (a bias that a following BatchNorm cancels) has a
    computed gradient of pure rounding noise: a ratio near the dtype's epsilon (`unison
    check-exact` names it as the likely cause of a difference). Every rank calls it (FSDP2
    shards are gathered).

        ratios = {}; note_gradient_sizes(learn, ratios); ratios["0.bias"]
    """
    sizes: dict[str, float] = {}
    for name, param in learn.raw_model.named_parameters():
        if param.grad is not None:
            grad = _full(param.grad)
            sizes[name] = float(grad.detach().abs().max()) if grad.numel() else 0.0
    largest = max(sizes.values(), default=0.0)
    if not largest > 0:  # no gradient, or NaN: nothing to compare with
        return
    for name, size in sizes.items():
        ratios[name] = max(ratios.get(name, 0.0), size / largest)


class ExactnessProbe(Callback):
    """Stop the first fit after `steps` optimizer steps and write what it reached to `path` (rank 0).

    Added by the `Learner` itself when `UNISON_EXACT_PROBE` is set (module docstring); not meant
    to be added by hand.
    """

    order = 90  # after the Recorder (50): its losses and metrics are in when this reads them

    def __init__(self, path: str | Path, steps: int, float64: bool = False):
        self.path = Path(path)
        self.steps = steps
        self.float64 = float64
        self.active = False
        self.steps_done = 0
        self.stop = False
        self._dtype: torch.dtype | None = None

    # ---- the probed fit ---------------------------------------------------------------
    def before_fit(self) -> None:
        learn = self.learn
        # An LR sweep (lr_find, which puts the model back; the fastai bridge marks its sweep with
        # `lr_finder = True`) is not the fit the check compares: the fit after it is.
        sweeping = learn.lr_finder is True or learn.get_cb(LRFinder) is not None
        self.active = not _claimed[0] and not sweeping
        if not self.active:
            return
        _claimed[0] = True
        self.steps_done, self.stop = 0, False
        self.loss_float64 = True  # False once a training loss comes in a lower precision (a float32 loss)
        self.loss_start = len(learn.recorder.losses)
        self.values_start = len(learn.recorder.values)
        self.initial = fingerprint(full_state(learn))
        self.grad_ratio: dict[str, float] = {}
        if self.float64:
            self._dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)

    def before_batch(self) -> None:
        if not self.float64:
            return
        learn = self.learn
        learn.xb, learn.yb = to_float64(learn.xb), to_float64(learn.yb)
        learn._padded_xb = to_float64(learn._padded_xb)  # what an empty validation share runs forward

    def after_loss(self) -> None:
        loss = self.learn.loss
        if self.active and self.learn.training and isinstance(loss, Tensor) and loss.is_floating_point():
            self.loss_float64 = self.loss_float64 and loss.dtype == torch.float64

    def before_step(self) -> None:
        if self.active and self.learn.training:
            note_gradient_sizes(self.learn, self.grad_ratio)

    def after_step(self) -> None:
        if self.active and self.learn.training:
            self.steps_done += 1
            self.stop = self.steps_done >= self.steps

    def after_batch(self) -> None:
        # Here, not in after_step: the Recorder has logged this batch's loss (after_batch, order 50).
        if self.active and self.stop and self.learn.training:
            raise CancelTrainException  # this epoch's validation still runs: metrics at this step

    def after_epoch(self) -> None:
        if self.active and self.stop:
            raise CancelFitException

    def after_fit(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._dtype is not None:
            torch.set_default_dtype(self._dtype)
        self.write()
        raise SystemExit(0)  # the check needs nothing more from this script

    # ---- the file ---------------------------------------------------------------------
    def write(self) -> None:
        """Write the record on rank 0 (atomically); every rank takes part in gathering the weights."""
        learn = self.learn
        weights = full_state(learn)
        if not learn.collective.is_main:
            return
        recorder = learn.recorder
        train = learn.dls.train
        record = {
            "format": PROBE_FORMAT,
            "world_size": int(learn.collective.world_size),
            "batch_size": getattr(train, "batch_size", None),
            "accumulate": int(getattr(learn, "accumulate", 1)),  # the own loop's Run(accumulate=k)
            "loss_float64": self.loss_float64,
            "steps": self.steps_done,
            "requested_steps": self.steps,
            "float64": self.float64,
            "losses": [float(v) for v in recorder.losses[self.loss_start :]],
            "metric_names": [str(n) for n in recorder.metric_names[1:-1]],
            "values": [[float(v) for v in row] for row in recorder.values[self.values_start :]],
            "initial": self.initial,
            "weights": weights,
            "grad_ratio": dict(self.grad_ratio),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".partial")
        torch.save(record, tmp)
        os.replace(tmp, self.path)
        print(
            f"unison check-exact: stopped after {self.steps_done} optimizer step(s) on "
            f"{learn.collective.world_size} process(es); recorded {self.path}",
            flush=True,
        )

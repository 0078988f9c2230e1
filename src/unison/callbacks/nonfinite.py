"""`NonFiniteCheck`: the first non-finite loss or gradient, on any rank, stops every rank at that step.

A NaN on one rank reaches every rank through the gradient all-reduce, and the optimizer step
then writes NaN into every rank's weights (and the next `Checkpoint` over the last good ones).
The `Learner` adds this callback (`Learner(on_nonfinite=...)`); it looks at each optimizer
step's gradients after they were reduced and before the step, and at each validation loss:

- `"stop"` (default): raise `NonFiniteError` on every rank at that step, naming the epoch,
  the step and the rank(s) whose batch produced it. Nothing is stepped or saved after it, so
  the weights and the last checkpoint are the last good ones; under `unison launch
  --max-restarts` the launcher does not restart into it.
- `"skip"`: leave that step out on every rank (no optimizer step, the BatchNorm statistics of
  its forward passes undone, its loss not recorded), as AMP's `GradScaler` skips an overflow.
- `"anomaly"`: as "stop", and each rank's batch is run again under
  `torch.autograd.detect_anomaly`, so the error names the backward op that made the NaN.

Cost. Every rank decides alone and all agree, without a new collective: under DDP the
gradients are all-reduced before the check, so every rank reads the same values; a rank's
non-finite loss is carried into them by backpropagating `loss * (loss * 0 + 1)` (the factor is
exactly 1 for a finite loss, NaN otherwise: the same gradients, bit for bit, when all is
well). The check is one pass over the gradients (their 2-norm, which any NaN or inf makes
non-finite; an exact element-wise check confirms it) and one host read of it. With
a grad scaler (fp16) the scaler's own overflow check is read instead: its skipped overflow
steps go on as before, only a non-finite loss stops. Sharded gradients (FSDP2) differ by rank,
so there one flag is all-reduced. Which rank produced it is found only on the failure path.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor, nn

from unison.callbacks.recorder import Recorder
from unison.distributed.fsdp import is_sharded
from unison.events import Callback, CancelBatchException
from unison.rng import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from unison.learner_view import LearnerView

Mode = Literal["stop", "skip", "anomaly"]
MODES: tuple[str, ...] = get_args(Mode)
_TRAIN_WHAT = ("loss", "gradient")


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient stopped every rank; `what`, `epoch`, `step` and `ranks` say where.

    `what` is "loss", "gradient" or "validation loss"; `step` is the batch of the epoch (for a
    validation loss, the first non-finite one); `ranks` the ranks whose batch produced it
    (None when they could not be found). The message is one line.

    >>> NonFiniteError("loss", epoch=0, step=5, ranks=(1,), value=float("nan")).where()
    'non-finite loss (nan) at epoch 0, step 5, from the batch of rank 1'
    """

    def __init__(
        self,
        what: str,
        epoch: int,
        step: int,
        ranks: Sequence[int] | None,
        value: float | None = None,
        detail: str = "",
    ):
        self.what, self.epoch, self.step = what, epoch, step
        self.ranks = None if ranks is None else tuple(int(r) for r in ranks)
        self.value, self.detail = value, detail
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.epoch, self.step, self.ranks, self.value, self.detail))

    def where(self) -> str:
        """`non-finite loss (nan) at epoch 0, step 5, from the batch of rank 1`."""
        value = "" if self.value is None else f" ({self.value})"
        phase = " of validation" if self.what == "validation loss" else ""
        if not self.ranks:
            who = "a rank that could not be found"
        elif len(self.ranks) == 1:
            who = f"the batch of rank {self.ranks[0]}"
        else:
            who = "the batches of ranks " + ", ".join(map(str, self.ranks))
        detail = f" ({self.detail})" if self.detail else ""
        where = f"at epoch {self.epoch}, step {self.step}{phase}"
        return f"non-finite {self.what}{value} {where}, from {who}{detail}"

    def _message(self) -> str:
        if self.what in _TRAIN_WHAT:
            tail = (
                "every rank stopped before the optimizer step: the weights and the last checkpoint are the "
                "last good ones (Learner(on_nonfinite='skip') skips such steps, 'anomaly' names the op)"
            )
        else:
            tail = (
                "every rank stopped before the epoch's end: no tracker or checkpoint saw it "
                "(Learner(on_nonfinite='skip') records it as nan and goes on)"
            )
        return f"{self.where()}: {tail}"


class NonFiniteWarning(UserWarning):
    """`on_nonfinite="skip"` left a step out, or recorded a non-finite validation loss (rank 0 warns)."""


class NonFiniteCheck(Callback):
    """Stop (or skip the step) at the first non-finite loss or gradient on any rank; see the module.

    The `Learner` adds one: `Learner(..., on_nonfinite="stop" | "skip" | "anomaly" | None)`.
    `skipped` lists the steps "skip" left out, as `(epoch, step, ranks)`.

        learn = Learner(dls, model, loss_func, on_nonfinite="skip")
    """

    # before_step after MixedPrecision's unscale (-5) and GradientAccumulation's micro-step
    # cancel (-20), before GradientClip (0); after_validate before the Recorder (50), the
    # trackers (70) and Checkpoint (90); a stop raises before any of them acts on the step.
    order = -2

    def __init__(self, mode: Mode = "stop"):
        if mode not in MODES:
            raise ValueError(
                f"on_nonfinite must be one of {', '.join(map(repr, MODES))} or None, got {mode!r}"
            )
        self.mode = mode
        self.skipped: list[tuple[int, int, tuple[int, ...] | None]] = []
        self._active = True
        self._losses: list[Tensor] = []  # this optimizer step's losses, on this rank
        self._valid_losses: list[Tensor] = []
        self._checking_valid = False
        self._step_open = False
        self._buffers: list[tuple[Tensor, Tensor]] = []

    # ---- when it applies ---------------------------------------------------------------
    def before_fit(self) -> None:
        from unison.callbacks.schedule import LRFinder

        learn = self.learn
        # lr_find's sweep diverges on purpose and has its own stop: it is left alone.
        self._active = learn.get_cb(LRFinder) is None
        self.skipped = []
        self._sharded = is_sharded(learn.model)
        # DDP: a rank's own loss enters the check through the reduced gradients (see the module).
        self._poison = learn.collective.world_size > 1 and not self._sharded
        self._params = [p for p in learn.model.parameters() if p.requires_grad]

    def after_fit(self) -> None:
        self._active, self._losses, self._buffers = True, [], []

    def before_train(self) -> None:
        self._step_open = False

    def before_batch(self) -> None:
        if not (self._active and self.learn.training) or self._step_open:
            return
        self._step_open = True  # the first batch of an optimizer step
        self._losses = []
        # a skipped step's forward passes must not move BatchNorm statistics or counts
        if self.mode == "skip":
            self._buffers = _saved_buffers(self.learn.model)

    def after_batch(self) -> None:
        if self.learn.training and self.learn.grad_sync:
            self._step_open = False

    # ---- training ----------------------------------------------------------------------
    def after_loss(self) -> None:
        learn = self.learn
        if not self._active or learn.loss is None:
            return
        if not learn.training:
            if self._checking_valid:
                self._valid_losses.append(learn.loss)
            return
        self._losses.append(learn.loss)
        grad_loss = learn.loss_grad
        if self._poison and grad_loss is not None and grad_loss.requires_grad:
            # Exactly 1 for a finite loss; NaN otherwise, and then every gradient of this rank is
            # NaN, so the all-reduced ones are too, on every rank.
            learn.loss_grad = grad_loss * (grad_loss.detach() * 0 + 1)

    def before_step(self) -> None:
        learn = self.learn
        if not self._active or not learn.training:
            return
        losses, self._losses = self._losses, []
        scaler = learn.scaler if learn.scaler is not None and learn.scaler.is_enabled() else None
        if not self._nonfinite(losses, scaler):
            return  # the hot path ends here
        # The ranks whose losses here are non-finite, and the first one's value (a collective).
        ranks: tuple[int, ...] | None
        ranks, values, _ = _gather_flags(learn.collective, _first_nonfinite(losses), learn.iter)
        what, value = "loss", values[0] if ranks else None
        if not ranks:
            if scaler is not None:
                return  # the scaled gradients overflowed: the scaler skips this step, as always
            what, ranks = "gradient", self._retraced_culprits()
        detail = self._anomaly_detail(ranks) if self.mode == "anomaly" else ""
        error = NonFiniteError(what, learn.epoch, learn.iter, ranks, value, detail)
        if scaler is not None:
            scaler.update()  # its unscale_ of this step is closed, as a skipped scaler step would
        if self.mode != "skip":
            raise error
        self._skip(error)

    def _nonfinite(self, losses: list[Tensor], scaler: torch.amp.GradScaler | None) -> bool:
        """Whether this step's (reduced) gradients, or a loss where it is not in them, are non-finite,
        with the same answer on every rank. One host read; under sharding one small all-reduce."""
        learn = self.learn
        parts: list[Tensor] = [] if self._poison else list(losses)
        overflow = _scaler_overflow(scaler, learn.opt) if scaler is not None else None
        if overflow is None:
            parts.extend(_local(p.grad) for p in self._params if p.grad is not None)
        parts = [t for t in parts if t.numel()]
        # Fast: a NaN or inf anywhere makes the 2-norm non-finite (the 2-norm is the fastest
        # reduction torch has on CPU, 6x its max|g|); so can a finite |g| > ~1e19 (its square
        # overflows), hence the exact check when it is not finite.
        if not self._agreed(_flags(parts, overflow, exact=False)):
            return False
        return self._agreed(_flags(parts, overflow, exact=True))

    def _agreed(self, bad: Tensor) -> bool:
        """`bad` read on the host, the same on every rank (sharded gradients differ: a flag is reduced)."""
        if self._sharded:
            return bool(self.learn.collective.sum(bad.reshape(1).double()).item() > 0)
        return bool(bad.item())

    def _retraced_culprits(self) -> tuple[int, ...] | None:
        """Every loss was finite: the ranks whose batch alone gives a non-finite gradient (each rank
        runs its batch again without the all-reduce), None where none is found. One process: rank 0."""
        collective = self.learn.collective
        if collective.world_size == 1:
            return (0,)
        if self._sharded:
            return None  # a sharded model's backward reduces as it goes: no rank can retrace alone
        bad, _ = self._retrace(anomaly=False)
        ranks, _, _ = _gather_flags(collective, (0, 0.0) if bad else None, self.learn.iter)
        return ranks or None

    def _anomaly_detail(self, ranks: tuple[int, ...] | None) -> str:
        """What torch's anomaly mode says of each culprit rank's batch, run again (a collective)."""
        if self._sharded:
            return "anomaly mode cannot retrace a sharded model's batch"
        _, said = self._retrace(anomaly=True)
        everyone = self.learn.collective.gather_objects(said)
        found = [f"rank {r}: {text}" for r, text in enumerate(everyone) if text and (not ranks or r in ranks)]
        return "; ".join(found) if found else "anomaly mode found no backward op returning NaN"

    def _retrace(self, anomaly: bool) -> tuple[bool, str | None]:
        """This rank's batch again, forward and backward, on this rank alone (BatchNorm local, no
        gradient stored, RNG and buffers put back): whether its loss or gradient is non-finite,
        and under `anomaly` the first line of torch's anomaly error."""
        learn = self.learn
        model = learn.raw_model
        params = [p for p in model.parameters() if p.requires_grad]
        rng = get_rng_state()
        buffers = _saved_buffers(model)
        pred = learn.pred
        try:
            with (
                _local_batchnorm(model),
                _autocast_of(learn),
                warnings.catch_warnings(),
                torch.autograd.detect_anomaly(check_nan=True) if anomaly else contextlib.nullcontext(),
            ):
                warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
                learn.pred = learn.call_model(model, learn.xb)
                total = learn.exact_loss.terms(learn)[0]
                if not total.requires_grad or not params:
                    return not bool(torch.isfinite(total).all()), None
                grads = torch.autograd.grad(total, params, allow_unused=True)
            checked = [total.detach(), *(g for g in grads if g is not None)]
            return bool(_flags([t for t in checked if t.numel()], None, exact=True)), None
        except RuntimeError as exc:
            if not anomaly:
                raise
            return True, str(exc).strip().splitlines()[0]
        finally:
            learn.pred = pred
            set_rng_state(rng)
            _put_back(buffers)

    def _skip(self, error: NonFiniteError) -> None:
        learn = self.learn
        _put_back(self._buffers)
        assert learn.opt is not None
        learn.opt.zero_grad(set_to_none=True)
        learn.loss = None  # not recorded: the epoch's loss is over the steps taken
        if isinstance(learn.recorder, Recorder):
            learn.recorder.forget_step()  # nor the step's earlier micro-batches (accumulation)
        self.skipped.append((error.epoch, error.step, error.ranks))
        self._warn_skipped(error, "skipped that step on every rank")
        raise CancelBatchException()

    def _warn_skipped(self, error: NonFiniteError, outcome: str) -> None:
        """Rank 0 says what "skip" did where `error` would have stopped every rank."""
        if self.learn.collective.is_main:
            warnings.warn(f"{error.where()}: {outcome} (on_nonfinite='skip')", NonFiniteWarning, stacklevel=3)

    # ---- validation --------------------------------------------------------------------
    def before_validate(self) -> None:
        # get_preds computes no loss; outside a fit (validate) no sweep runs: _active is True
        self._checking_valid = self.learn.score and self._active
        self._valid_losses = []

    def after_validate(self) -> None:
        if not self._checking_valid:
            return
        self._checking_valid = False
        learn = self.learn
        losses, self._valid_losses = self._valid_losses, []
        # One small all-reduce per validation pass: which ranks saw a non-finite loss, and where.
        ranks, values, steps = _gather_flags(learn.collective, _first_nonfinite(losses), None)
        if not ranks:
            return
        error = NonFiniteError("validation loss", learn.epoch, min(steps), ranks, values[0])
        if self.mode != "skip":
            raise error
        self._warn_skipped(error, "recorded as nan; no tracker takes it as best")


# ---- helpers -----------------------------------------------------------------------------------
def _saved_buffers(model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Each of `model`'s buffers (BatchNorm statistics and counts) with a copy of its values now."""
    return [(b, b.detach().clone()) for b in model.buffers()]


def _put_back(buffers: list[tuple[Tensor, Tensor]]) -> None:
    """Each buffer's values as `_saved_buffers` copied them."""
    with torch.no_grad():
        for buf, saved in buffers:
            buf.copy_(saved)


def _local(grad: Tensor) -> Tensor:
    """A sharded (DTensor) gradient's own shard; a plain gradient as it is."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _flags(parts: list[Tensor], overflow: Tensor | None, exact: bool) -> Tensor:
    """True where some element of `parts` is NaN or inf (or the scaler found one); not `exact`: a
    finite element above ~1e19 may also read as non-finite (see `NonFiniteCheck._nonfinite`)."""
    flags: list[Tensor] = []
    if parts and exact:
        flags.extend(~torch.isfinite(t).all() for t in parts)
    elif parts:
        norms = list(torch._foreach_norm(parts, 2))  # one call for every tensor (as clip_grad_norm_)
        dev, dtype = norms[0].device, norms[0].dtype
        if any(n.device != dev or n.dtype != dtype for n in norms):
            norms = [n.to(dev, torch.float32) for n in norms]
        flags.append(~torch.isfinite(torch.stack(norms).sum()))
    if overflow is not None:
        flags.append(overflow.sum() > 0)
    if not flags:
        return torch.tensor(False)
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.to(flags[0].device) for f in flags]).any()


def _scaler_overflow(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer | None) -> Tensor | None:
    """The scaler's found-inf flags of this step (after its `unscale_`), stacked; None when it has
    none yet (then the gradients themselves are read)."""
    if opt is None:
        return None
    try:
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]  # torch's GradScaler
    except (AttributeError, KeyError, TypeError):
        return None
    if not found:
        return None
    flags = list(found.values())
    return torch.stack([f.reshape(()).to(flags[0].device) for f in flags])


def _first_nonfinite(losses: list[Tensor]) -> tuple[int, float] | None:
    """(index, value) of the first non-finite loss in `losses` (one host read), or None."""
    if not losses:
        return None
    values = torch.stack([v.reshape(()).to(losses[-1].device) for v in losses]).double().cpu()
    bad = (~torch.isfinite(values)).nonzero()
    if not len(bad):
        return None
    i = int(bad[0, 0])
    return i, float(values[i])


def _gather_flags(
    collective: Any, first: tuple[int, float] | None, step: int | None
) -> tuple[tuple[int, ...], list[float], list[int]]:
    """Every rank's (flag, value, step) in one all-reduce of a 3 x W tensor (rank r writes column r):
    the flagged ranks, their values and steps (`step`, or each rank's own index in `first`)."""
    world, rank = collective.world_size, collective.rank
    table = torch.zeros(3, world, dtype=torch.float64)
    if first is not None:
        index, value = first
        table[0, rank], table[1, rank] = 1.0, value
        table[2, rank] = float(step if step is not None else index)
    table = collective.sum(table)  # identity on one process
    ranks = tuple(r for r in range(world) if table[0, r] > 0)
    return ranks, [float(table[1, r]) for r in ranks], [int(table[2, r]) for r in ranks]


@contextlib.contextmanager
def _local_batchnorm(model: nn.Module) -> Iterator[None]:
    """Synchronised BatchNorm layers run as plain local ones (no collective, so one rank can run
    alone, and anomaly mode may raise mid-backward) for the duration of the block."""
    from unison.distributed.sync_bn import BatchNormNd, SyncBatchNorm

    swapped = [m for m in model.modules() if isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))]
    classes = [type(m) for m in swapped]
    for m in swapped:
        setattr(m, "__class__", BatchNormNd)  # noqa: B010 (mypy refuses a __class__ assignment)
    try:
        yield
    finally:
        for m, cls in zip(swapped, classes, strict=True):
            m.__class__ = cls


def _autocast_of(learn: LearnerView) -> contextlib.AbstractContextManager[Any]:
    """The autocast the training forward ran under (`MixedPrecision`), for a faithful retrace."""
    from unison.callbacks.precision import MixedPrecision

    mp = learn.get_cb(MixedPrecision)
    if mp is None:
        return contextlib.nullcontext()
    return torch.autocast(learn.device.type, dtype=mp.dtype)

"""`MixedPrecision`: autocast the forward pass; on CUDA with fp16, scale the loss."""

from __future__ import annotations

import contextlib
import warnings

import torch

from unison.distributed.devices import bf16_supported
from unison.events import Callback

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class MixedPrecision(Callback):
    """Run forward and loss under `torch.autocast`; keep weights and gradients in float32.

    - `"bf16"`: bfloat16 autocast, on CPU and on CUDA; no loss scaling needed.
    - `"fp16"`: float16 autocast on CUDA with a `GradScaler` (`learn.scaler`), whose
      state goes into checkpoints. Asked on a machine without CUDA it is an error,
      never a silent no-op.

        learn = Learner(dls, model, loss_func, cbs=[MixedPrecision("bf16")])
    """

    order = -5  # unscale gradients in before_step ahead of GradientClip (order 0)

    def __init__(self, dtype: str = "bf16"):
        if dtype not in _DTYPES:
            raise ValueError(f"MixedPrecision: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        if self.dtype is torch.float16 and not torch.cuda.is_available():
            raise ValueError(
                "MixedPrecision('fp16') needs a CUDA GPU and none is available: use "
                "MixedPrecision('bf16') on CPU"
            )
        self._autocast = contextlib.ExitStack()  # the batch's autocast while it is entered

    def before_fit(self) -> None:
        device = self.learn.device
        if self.dtype is torch.float16 and device.type != "cuda":
            raise ValueError(
                f"MixedPrecision('fp16') needs the model on a CUDA device, it is on {device}: "
                "use MixedPrecision('bf16') on CPU"
            )
        if self.dtype is torch.bfloat16 and device.type == "cuda" and not bf16_supported():
            warnings.warn(
                f"MixedPrecision('bf16'): {torch.cuda.get_device_name(device)} has no native bfloat16 "
                "(it needs an Ampere GPU or later) and emulates it slowly: use MixedPrecision('fp16')",
                stacklevel=2,
            )
        if self.dtype is torch.float16 and self.learn.scaler is None:
            self.learn.scaler = torch.amp.GradScaler("cuda")

    def before_batch(self) -> None:
        self._autocast.enter_context(torch.autocast(self.learn.device.type, dtype=self.dtype))

    #: A torchft step redone after its vote failed runs its forward pass in the same precision again.
    before_redo = before_batch

    def after_loss(self) -> None:
        self._autocast.close()  # backward runs outside autocast, as torch recommends

    def before_step(self) -> None:
        if self.learn.scaler is not None and self.learn.opt is not None:
            self.learn.scaler.unscale_(self.learn.opt)  # clipping sees the true gradients

    def after_batch(self) -> None:
        self._autocast.close()  # a batch cancelled before its loss (closing a closed one does nothing)

    after_cancel_batch = after_batch

    def after_fit(self) -> None:
        self._autocast.close()
        self.learn.scaler = None

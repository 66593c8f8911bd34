"""Precision, one component for both torch clients (the Trainer's `TorchFramework` and the own loop,
`polytrain.torch.Distributed`): autocast, the fp16 loss scaler, the update's sequence (unscale → clip → step) and
which updates do not count.

- ``fp32``: no autocast, no scaler; ``bf16``: autocast; ``fp16``: autocast and a dynamic loss scaler, the backend's
  (`TorchBackendContract.grad_scaler`: a sharded backend's agrees across ranks), unless the backend scales the loss
  itself (``owns_loss_scaler``: DeepSpeed's engine, which then says whether it applied each update).
- A backend whose weights are in the training precision (``weights_in_precision``) gets floating-point inputs cast
  to it (`convert_input`); one that clips inside its step (``clips_in_step``) is not asked to clip.
- The non-finite policy: fp16 leaves an overflowed step to its scaler (skipped, the scale halved, counted here);
  with ``checks_finite`` (the Trainer's fp32/bf16 runs, `TrainSpec.checks_finite`) the backend checks every step's
  gradients (`grads_finite`) and a step the Trainer's ``reliability.on_nonfinite`` skips is `discard`-ed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from polytrain.adapters.torch.contract import TorchBackendContract
from polytrain.spec.tables import TrainSpec

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: a loss scaler's state entries that are integers (a checkpoint holds every entry as a float)
SCALER_INTS = ("growth_interval", "_growth_tracker")


class Precision:
    """The precision of one model and its optimizer, as ``backend`` runs them. Made before the backend's ``wrap``:
    it tells the backend whether gradients are checked every step (``checks_finite``)."""

    def __init__(self, spec: TrainSpec, backend: TorchBackendContract, *, checks_finite: bool = False) -> None:
        self.backend = backend
        self.dtype = AUTOCAST_DTYPES.get(spec.precision)
        self.device_type = backend.device.type
        self._input_dtype = self.dtype if backend.weights_in_precision else None
        self.checks_finite = backend.checks_finite = checks_finite
        owned = spec.precision != "fp16" or backend.owns_loss_scaler
        self.scaler: Any = None if owned else backend.grad_scaler()
        self.updates = 0  # optimizer steps run (applied or skipped)
        self.skipped = 0  # of which the loss scaler (or a backend's own) skipped after an overflow
        self._unscaled = False

    # ---------------------------------------------------------------- forward
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (bf16/fp16; nothing for fp32)."""
        return autocast(self.dtype, self.device_type)

    def convert_input(self, x: Any) -> Any:
        """``x`` in the dtype of a backend's bf16/fp16 weights (``weights_in_precision``: its forward runs with
        autocast off, so autocast around it no longer casts them) where ``x`` is a floating-point tensor."""
        dtype = self._input_dtype
        return x.to(dtype) if dtype is not None and torch.is_tensor(x) and x.is_floating_point() else x

    def forward(self, forward: Any) -> Any:
        """``forward`` run under autocast (and `convert_input` on its tensor arguments), its floating-point outputs
        returned as fp32, so a loss outside it is computed at full precision (as Fabric and Accelerate do); for
        fp32, ``forward`` itself."""
        if self.dtype is None:
            return forward
        convert = self.convert_input

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._input_dtype is not None:
                args, kwargs = tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}
            with torch.autocast(device_type=self.device_type, dtype=self.dtype):
                out = forward(*args, **kwargs)
            return to_fp32(out)

        return run

    # ---------------------------------------------------------------- backward and the update
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from: multiplied by fp16's loss scale where this component scales it."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, once per update (clipping must see the true gradients)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float | None:
        """Clip the (unscaled) gradients to ``max_norm``; the norm before clipping. None where the backend clips
        inside its step (``clips_in_step``)."""
        if self.backend.clips_in_step:
            return None
        self.unscale(optimizer)
        return self.backend.clip_grad_norm(model, max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Apply the update through the backend; with a loss scaler, skipped after an overflow (on every rank alike:
        the gradients are synchronised, or the scaler agrees across shards) and the scale updated. Returns whether
        it was applied where it could be skipped (False: skipped, and counted), else None."""
        self._unscaled = False
        self.updates += 1
        scaler = self.scaler
        if scaler is None:
            applied = self.backend.optimizer_step(optimizer)
        else:
            before = scaler.get_scale()
            self.backend.optimizer_step(optimizer, scaler.step)
            scaler.update()
            applied = scaler.get_scale() >= before  # the scale only shrinks after an overflow (a skipped step)
        if applied is False:
            self.skipped += 1
        return applied

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               clip_norm: float | None) -> tuple[float | None, bool | None]:
        """One whole update: unscale → clip (when ``clip_norm``) → step. Returns the norm and `step`'s answer."""
        self.unscale(optimizer)
        norm = self.clip(model, optimizer, clip_norm) if clip_norm is not None else None
        return norm, self.step(optimizer)

    # ---------------------------------------------------------------- the non-finite policy
    def grads_finite(self, model: nn.Module) -> bool:
        """Whether every synchronised gradient is finite, the same answer on every rank (the backend's check)."""
        return self.backend.grads_finite(model)

    def discard(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's gradients without an update (a non-finite step the policy skips)."""
        self._unscaled = False
        optimizer.zero_grad()  # set_to_none (torch 2 default; Horovod 0.28 takes no argument)

    # ---------------------------------------------------------------- what runs and checkpoints show
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None when no loss scaling runs."""
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        return self.backend.loss_scale()

    def stats(self) -> dict[str, float]:
        """Skipped (overflowed) updates and the loss scale, where a loss scale runs; else nothing."""
        scale = self.loss_scale()
        return {} if scale is None else {"skipped_steps": float(self.skipped), "loss_scale": scale}

    def state_dict(self) -> dict[str, float] | None:
        """The loss scaler's state for a checkpoint (None without one)."""
        if self.scaler is None:
            return None
        return {key: float(value) for key, value in self.scaler.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, float] | None) -> None:
        """Put a checkpoint's loss scaler state back (nothing without a scaler or a state)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict({k: (int(v) if k in SCALER_INTS else v) for k, v in state.items()})


def check_fp16_runs(device: torch.device) -> None:
    """Raise a one-line error when fp16 autocast cannot run on ``device`` (old CPUs / builds)."""
    from polytrain.errors import BackendUnavailableError

    try:
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            out = torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        if out.dtype != torch.float16:
            raise RuntimeError(f"autocast produced {out.dtype}")
    except RuntimeError as exc:
        reason = " ".join(str(exc).split())[:120]
        raise BackendUnavailableError(f"precision: fp16 cannot run on {device} here ({reason}); use bf16 or fp32") \
            from None


def autocast(dtype: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype`` on ``device_type``; nothing where ``dtype`` is None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def to_fp32(out: Any) -> Any:
    """``out``'s floating-point tensors (below fp64) as fp32, through dicts, lists and tuples; anything else as it is."""
    if torch.is_tensor(out):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if type(out) is dict:
        return {k: to_fp32(v) for k, v in out.items()}
    if type(out) in (list, tuple):
        return type(out)(to_fp32(v) for v in out)
    return out  # other containers as they are

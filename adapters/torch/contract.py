"""The torch backend contract: everything the Trainer's `TorchFramework` and the own loop (`polytrain.torch.Distributed`)
call or read on a PyTorch backend, declared once.

`polytrain.protocols.Backend` is what the framework-neutral Trainer calls (collectives, setup, teardown); a torch
backend adds the hooks that run a model: wrap it, run a micro-step, clip, step, hand over its full state. Both torch
clients hold a backend as a `TorchBackendContract` and never ask for its name: what a backend does itself is one of
the flags below (DeepSpeed's engine casts nothing for autocast, clips inside its step, scales the fp16 loss itself,
and marks its own accumulation boundary in `no_sync`). `adapters/torch/backend.py`'s `TorchBackend` implements it
(every backend subclasses it); precision (autocast, the loss scaler, unscale → clip → step, which steps may not
count) is `adapters/torch/precision.py`, which reads these flags.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from polytrain.protocols import Backend

if TYPE_CHECKING:
    import torch
    from torch import nn

    from polytrain.spec.tables import TrainSpec
    from polytrain.world import World

#: a loss on (outputs, targets) summed over the samples: what a micro-step runs backward from
LossSum = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
#: what applies an update: ``torch.optim.Optimizer.step`` itself, or a loss scaler's ``step`` (which skips it
#: after an overflow)
StepFn = Callable[["torch.optim.Optimizer"], Any]


@runtime_checkable
class TorchBackendContract(Backend, Protocol):
    """A PyTorch distribution backend as both torch clients use it (see the module's docstring)."""

    #: the validated spec the backend was made for
    spec: TrainSpec
    #: this process's place in the job (rank, size, local rank); `setup` may fill in the master's address
    world: World
    #: the device this rank trains on (``cuda:<local rank>`` or ``cpu``)
    device: torch.device
    #: whether ``wrap`` remakes the module (shards or partitions its parameters, adds hooks bound to the job): the
    #: Trainer then hands back an outline of the plain module, filled at the end (`TorchFramework.release`)
    alters_module: bool
    #: set by the precision component before ``wrap``: whether every step's gradients are checked for NaN/Inf
    #: (`grads_finite`); a backend that reduces gradients itself may check them as it does (ddp)
    checks_finite: bool
    #: the backend keeps the weights themselves in the training precision (bf16/fp16) and runs its forward with
    #: autocast off (DeepSpeed's engine): floating-point inputs must come in that dtype
    weights_in_precision: bool
    #: the backend clips inside its optimizer step, at the norm it was built with (``loop.grad_clip_norm``):
    #: `clip_grad_norm` is not called, and no norm is reported
    clips_in_step: bool
    #: fp16: the backend scales the loss and skips an overflowed update itself (`optimizer_step` returns whether
    #: it applied it, `loss_scale` the scale); `grad_scaler` is then not asked
    owns_loss_scaler: bool
    #: under polytrain's elastic driver: why this backend cannot go on in place after a lost peer (one line naming
    #: the field), or None when every rank holds the whole training state, so its own commit is enough (ddp;
    #: horovod on polytrain's implementation): the Trainer and the own loop ask this, never the name
    in_place_refusal: str | None
    #: ``wrap`` binds the module's parameters to the job's group (FSDP2's DTensors on its mesh): an elastic re-form
    #: wraps a fresh module of the same classes rather than the same one again (`elastic_group.regroup`)
    binds_module_to_group: bool

    # ---------------------------------------------------------------- the model
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model (on the device) and its optimizer as the backend trains them: DDP's module, FSDP's sharded one,
        DeepSpeed's engine and its optimizer; the plain ones where the backend adds nothing."""
        ...

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module inside what `wrap` returned."""
        ...

    def unwrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer `wrap` was given, inside what it returned (an elastic re-form wraps it again)."""
        ...

    def bind_data(self, info: Any) -> None:
        """Told the dataset's `DatasetInfo` before `wrap` (a layout that cuts the model needs an example input)."""
        ...

    def parameter_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every parameter, by portable name; no communication."""
        ...

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """``torch.compile`` the wrapped model in place (spec ``compile``), where the backend's layout allows it."""
        ...

    # ---------------------------------------------------------------- one step
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-step that is not a step's last: gradients accumulate without being synchronised.
        A backend with an accumulation boundary of its own (DeepSpeed's engine) marks it here, so the boundary is
        wherever the client's window ends."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of ``loss`` (already scaled by the precision's loss scaler), with the backend's
        gradient sync after the last micro-step where it syncs itself (horovod, mpi, a layout's data dimension)."""
        ...

    def train_micro_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_sum: LossSum, scale: float,
                         sync: bool, autocast: contextlib.AbstractContextManager[Any], scaler: Any | None) -> float:
        """Forward and backward of one micro-batch (the Trainer's); returns the summed loss of its samples. The
        backward pass runs on ``loss_sum(model(x), y) * scale`` (through ``scaler`` when there is one), under
        `no_sync` unless ``sync``. A layout whose schedule runs forward and backward itself (a pipeline) overrides it."""
        ...

    def eval_outputs(self, model: nn.Module, x: torch.Tensor,
                     autocast: contextlib.AbstractContextManager[Any]) -> torch.Tensor | None:
        """The outputs of the plain ``model`` for ``x``, forward only; None on a rank that holds no outputs (a
        pipeline's stages before the last)."""
        ...

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float | None:
        """Clip the synchronised (unscaled) gradients to ``max_norm`` over the whole model (sharded: a global norm);
        returns the norm before clipping."""
        ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: StepFn | None = None) -> bool | None:
        """Apply the update as the backend runs it: ``step(optimizer)`` (the loss scaler's, which skips an overflowed
        update), else ``optimizer.step()``. A backend that may skip it itself (`owns_loss_scaler`) returns whether
        it applied it; None otherwise."""
        ...

    def grads_finite(self, model: nn.Module) -> bool:
        """True when no gradient holds a NaN or Inf: the same answer on every rank (sharded backends all-reduce it)."""
        ...

    # ---------------------------------------------------------------- fp16 loss scaling
    def grad_scaler(self) -> Any:
        """A new dynamic loss scaler for fp16 that suits the backend's gradients (a sharded one agrees across ranks
        on whether any overflowed). Asked only for fp16, and only where not `owns_loss_scaler`; may raise
        `BackendUnavailableError`/`SpecError` where fp16 cannot run."""
        ...

    def loss_scale(self) -> float | None:
        """The current loss scale of a backend that `owns_loss_scaler` (None otherwise)."""
        ...

    # ---------------------------------------------------------------- full (portable) state, collective
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state by portable name (collective on sharded backends: every rank calls it)."""
        ...

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Put a whole model's state (portable names) into the wrapped model (collective on sharded backends)."""
        ...

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Optimizer state as ``<parameter name>/<slot>`` → full tensor (collective on sharded backends)."""
        ...

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        """Put ``<parameter name>/<slot>`` full tensors into the optimizer's state (collective on sharded backends)."""
        ...

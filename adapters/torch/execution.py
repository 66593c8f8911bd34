"""How the model's forward and backward run: activation checkpointing of its blocks, and ``torch.compile``.

Activation checkpointing (spec ``activation_checkpointing``, or its alias ``fsdp.activation_checkpointing``)
works the same on every PyTorch backend: each block the model declares (``model.block_classes``; under
``fsdp``, the classes named in ``fsdp.units`` when set) runs its forward under
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved), so the block keeps only its input and
recomputes what is inside it in the backward pass. The block's ``forward`` is replaced on the instance,
not wrapped in another module: parameter names, state dicts and checkpoints stay those of the plain
model, and ``torch.compile`` traces the block as a checkpointed region (its partitioner recomputes it).

``torch.compile`` (spec ``compile``) runs as ``nn.Module.compile`` — in place, names unchanged — on the
module each backend names in `TorchBackend.compile_model`: the model itself (``local``, ``horovod``,
``mpi``), the DDP module (``ddp``: dynamo then splits the graph at DDP's gradient buckets so their
all-reduces still overlap the backward pass), every unit and the root after ``fully_shard`` (``fsdp``:
FSDP2's hooks stay outside the compiled regions) and DeepSpeed's ``engine.compile`` (``deepspeed``).
"""

from __future__ import annotations

import os
import shutil
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polytrain.errors import BackendUnavailableError, SpecError
from polytrain.spec.tables import TrainSpec


def checkpointing_on(spec: TrainSpec) -> bool:
    """Whether the spec asks for activation checkpointing (the top-level field or its fsdp alias)."""
    return spec.activation_checkpointing or spec.fsdp.activation_checkpointing


def find_unit_classes(model: nn.Module, names: tuple[str, ...] | None) -> tuple[type[nn.Module], ...]:
    """The module classes to shard as units: named ones (class name or module.QualName), else the model's own."""
    if names is None:
        return tuple(getattr(model, "block_classes", ()))
    present = {type(m) for m in model.modules()} - {type(model)}
    chosen: list[type[nn.Module]] = []
    for name in names:
        matches = [c for c in present if name in (c.__name__, f"{c.__module__}.{c.__qualname__}")]
        if not matches:
            known = ", ".join(sorted({c.__name__ for c in present})) or "none"
            raise SpecError(f"fsdp.units: no module of class {name!r} in the model (its classes: {known})")
        chosen.extend(matches)
    return tuple(dict.fromkeys(chosen))


def block_modules(model: nn.Module, names: tuple[str, ...] | None) -> list[nn.Module]:
    """Every module of the block classes (`find_unit_classes`), outermost first; never the model itself."""
    classes = find_unit_classes(model, names)
    return [m for m in model.modules() if m is not model and isinstance(m, classes)] if classes else []


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (a class's function) run under non-reentrant activation checkpointing."""

    def checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)

    checkpointed_forward.polytrain_checkpointed = True  # type: ignore[attr-defined]
    return checkpointed_forward


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint_blocks` made ``module`` recompute its activations."""
    return getattr(module.__dict__.get("forward"), "polytrain_checkpointed", False)


def checkpoint_blocks(spec: TrainSpec, model: nn.Module) -> list[nn.Module]:
    """Apply activation checkpointing to the model's declared blocks (see the module's docstring).

    Nested blocks: only the outermost of each nest is checkpointed (its recomputation covers the inner
    ones). Raises a one-line `SpecError` when the model declares no blocks. Returns the checkpointed blocks."""
    blocks = block_modules(model, spec.fsdp.units)
    if not blocks:
        field = "activation_checkpointing" if spec.activation_checkpointing else "fsdp.activation_checkpointing"
        where = "name their classes in fsdp.units" if spec.backend == "fsdp" else \
            "give the model a block_classes attribute (the classes of its repeated blocks)"
        raise SpecError(f"{field}: the model declares no blocks to checkpoint; {where}")
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    for block in blocks:  # model.modules() order: a block comes before the modules inside it
        if id(block) in inside:
            continue
        inside.update(id(m) for m in block.modules())
        if "forward" in block.__dict__:
            raise SpecError(f"activation_checkpointing: block {type(block).__name__} has its forward replaced on "
                            "the instance; checkpointing needs the class's own forward")
        block.forward = types.MethodType(_checkpointed(type(block).forward), block)  # type: ignore[method-assign]
        chosen.append(block)
    return chosen


def check_compiler(device: torch.device) -> None:
    """torch.compile's CPU code (inductor) is C++ built at run time: a compiler must be on PATH."""
    if device.type != "cpu":
        return
    candidates = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(name and shutil.which(name) for name in candidates):
        raise BackendUnavailableError("compile.enabled: torch.compile on CPU needs a C++ compiler (g++ or clang++, "
                                      "or CXX) on PATH; install one, or set compile.enabled: false")


def compile_module(module: nn.Module, mode: str) -> None:
    """``torch.compile`` ``module`` in place (``nn.Module.compile``): its names and state dict are unchanged."""
    module.compile(mode=mode)

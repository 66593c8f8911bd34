"""A user's model for tensor and pipeline parallel tests: a residual MLP on digits, its own
``parallelize_module`` plan (``parallel.tensor_plan: tp_user_model:plan``) and the pipeline methods
(``embed``/``finish`` and ``block_classes``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResidualMLP(nn.Module):
    block_classes: ClassVar[tuple[type[nn.Module], ...]] = (Residual,)

    def __init__(self, inputs: int, width: int, depth: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, outputs)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inp(x.flatten(1)))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.finish(x)


def make(info: Any, width: int = 32, depth: int = 4) -> ResidualMLP:
    inputs = 1
    for d in info.input_shape:
        inputs *= d
    return ResidualMLP(inputs, width, depth, info.num_outputs)


def plan(model: ResidualMLP, mesh: Any) -> dict[str, Any]:
    """Megatron's MLP split in every block: ``up`` by columns, ``down`` by rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for i in range(len(model.layers)):
        styles[f"layers.{i}.up"] = ColwiseParallel()
        styles[f"layers.{i}.down"] = RowwiseParallel()
    return styles


def broken_plan(model: ResidualMLP, mesh: Any) -> dict[str, Any]:
    """Names a module the model does not have."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"layers.0.gate": ColwiseParallel()}


class FaultyResidualMLP(ResidualMLP):
    """SIGKILLs itself at the ``FAULT_AT``-th training forward on rank ``FAULT_RANK`` (as faulty_model.py)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        import signal

        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == os.environ.get("FAULT_RANK") and self.calls == int(os.environ["FAULT_AT"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def make_faulty(info: Any, width: int = 32, depth: int = 4) -> ResidualMLP:
    inputs = 1
    for d in info.input_shape:
        inputs *= d
    return FaultyResidualMLP(inputs, width, depth, info.num_outputs)

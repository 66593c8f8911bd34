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


class ProbedResidualMLP(ResidualMLP):
    """Records, once, what FSDP made of the first block, into ``$PROBE_DIR/rank-<RANK>.json`` — at ``finish``,
    when every block has run its forward: the mesh of the weight left registered there (FSDP registers the
    sharded DTensor again after a forward that reshards, the gathered one otherwise), and the sharding, offload
    and mixed-precision policy of the block's parameter group."""

    probed = False

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self.probed:
            self.probed = True
            _probe(self.layers[0])
        return super().finish(x)


def _probe(block: nn.Module) -> None:
    import json
    import os
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    weight = block.up.weight
    group = block._get_fsdp_state()._fsdp_param_group  # FSDP2 has no public getter for its policies
    mesh = group.mesh_info.mesh
    record = {"registered_after_forward": list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor)
              else [], "registered_dtype": str(weight.dtype),
              "data_mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
              "offload": all(param.offload_to_cpu for param in group.fsdp_params),
              "param_dtype": str(group.mp_policy.param_dtype), "reduce_dtype": str(group.mp_policy.reduce_dtype)}
    out = Path(os.environ["PROBE_DIR"]) / f"rank-{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(record))


def make_probed(info: Any, width: int = 32, depth: int = 4) -> ResidualMLP:
    inputs = 1
    for d in info.input_shape:
        inputs *= d
    return ProbedResidualMLP(inputs, width, depth, info.num_outputs)


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

"""``fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) over gloo (CPU) or NCCL (GPU).

Sharding strategies (``fsdp.sharding``), as device meshes and ``reshard_after_forward``:

- ``full_shard``: a 1-D mesh over all ranks; parameters re-sharded after each unit's
  forward (ZeRO-3-like).
- ``shard_grad_op``: the same mesh, but parameters stay gathered from forward to
  backward (ZeRO-2-like: gradients and optimizer state sharded).
- ``hybrid_shard``: a 2-D mesh, replicate across nodes × shard within a node
  (HSDP). On one machine the mesh is 1 × N, i.e. ``full_shard``.
- ``no_shard``: a 2-D mesh N × 1: every rank holds everything and gradients are
  all-reduced — DDP's semantics through FSDP2's code path (FSDP2 has no NO_SHARD of
  its own; use ``ddp`` when you want DDP's bucketed implementation).

Units: every module of the classes named in ``fsdp.units`` (default: the model's
``block_classes``) is sharded on its own, then the root; activation checkpointing (the spec's
``activation_checkpointing``, or its alias ``fsdp.activation_checkpointing``) recomputes those
units in the backward pass (applied before sharding, see `execution.checkpoint_blocks`). ``fully_shard`` replaces the model's
parameters with DTensors, so `wrap` builds the spec's optimizer again over them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.backend import TorchBackend, check_fp16_runs
from polytrain.adapters.torch.execution import block_modules, compile_module, find_unit_classes
from polytrain.errors import SpecError

MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RESHARD_AFTER_FORWARD = {"full_shard": True, "shard_grad_op": False, "hybrid_shard": True, "no_shard": False}
__all__ = ["FSDPBackend", "MIXED_DTYPES", "RESHARD_AFTER_FORWARD", "find_unit_classes", "mesh_shape"]


def mesh_shape(sharding: str, size: int, num_nodes: int, local_size: int) -> tuple[int, ...]:
    """The device mesh of a sharding strategy: (shard,) or (replicate, shard)."""
    if sharding == "hybrid_shard":
        if num_nodes * local_size != size:
            raise SpecError(f"fsdp.sharding: hybrid_shard needs the same number of processes on every node; got "
                            f"{size} processes on {num_nodes} node(s) with {local_size} per node")
        return (num_nodes, local_size)
    if sharding == "no_shard":
        return (size, 1)
    return (size,)


class FSDPBackend(TorchBackend):
    name = "fsdp"
    traces_collectives = True  # the library issues them: the timeline records each

    def setup(self) -> None:
        super().setup()
        self.ensure_process_group()  # one process: FSDP still needs one

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        world, sharding = self.world, self.spec.fsdp.sharding
        shape = mesh_shape(sharding, world.size, world.num_nodes, world.local_size)
        if sharding == "hybrid_shard":
            # init_device_mesh puts ranks row by row: each row must be one node's ranks.
            node_major = world.rank == world.node_rank * world.local_size + world.local_rank
            if not all(self.all_gather_object(node_major)):
                raise SpecError("fsdp.sharding: hybrid_shard needs ranks numbered node by node "
                                "(rank = node_rank × processes per node + local_rank); the launcher interleaved them")
        if len(shape) == 1:
            return init_device_mesh(self.device.type, shape, mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))

    def _shard_options(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        fsdp = self.spec.fsdp
        options: dict[str, Any] = {"mesh": self._mesh(), "reshard_after_forward": RESHARD_AFTER_FORWARD[fsdp.sharding]}
        dtype = MIXED_DTYPES.get(self.spec.precision)
        if dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32 if fsdp.reduce_fp32 else dtype)
        if fsdp.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        return options

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.fsdp import fully_shard

        units = block_modules(model, self.spec.fsdp.units)  # checkpointed already when asked (framework.build)
        options = self._shard_options()
        for unit in reversed(units):  # innermost first, as fully_shard requires
            fully_shard(unit, **options)
        fully_shard(model, **options)
        self._units = units
        from polytrain.adapters.torch.framework import make_optimizer

        # The given optimizer points at the replaced (unsharded) parameters: build the spec's over the new ones.
        return model, make_optimizer(self.spec.optimizer, model.parameters())

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """Each unit, then the root, in place: FSDP2's all-gather and reduce-scatter hooks run around the
        compiled regions (dynamo leaves FSDP hooks eager), so they keep their overlap with compute."""
        for unit in getattr(self, "_units", []):
            compile_module(unit, mode)
        compile_module(model, mode)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # DTensor-aware: a global norm
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def grads_finite(self, model: nn.Module) -> bool:
        """Each rank checks its gradient shards; one all-reduce gives every rank the same answer."""
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters() if p.grad is not None]
        bad = float(any(not bool(torch.isfinite(g).all()) for g in grads if g.numel()))
        return self.all_reduce(np.array([bad]), op="max")[0] == 0.0

    def grad_scaler(self) -> Any | None:
        if self.spec.precision != "fp16":
            return None
        check_fp16_runs(self.device)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=self.device.type)  # all-reduces "found inf" over the shards

    # ---------------------------------------------------------------- full (unsharded) state, every rank
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {k: v.to(self.device) for k, v in state.items()}  # set_model_state_dict rewrites the dict it gets
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return {f"{name}/{key}": torch.as_tensor(value).detach().cpu()
                for name, slots in osd["state"].items() for key, value in slots.items()}

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        load_optimizer_state_dcp(model, optimizer, state, self.device)


def load_optimizer_state_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, torch.Tensor],
                             device: torch.device, elsewhere: Container[str] = ()) -> None:
    """Portable optimizer state (``<parameter>/<slot>``) into a model of DTensor parameters, through
    torch.distributed.checkpoint; state of the parameters named in ``elsewhere`` (held by other ranks, as
    other pipeline stages' are) is skipped, of any other unknown parameter refused."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    current = get_optimizer_state_dict(model, optimizer, options=options)
    known = {name for group in current["param_groups"] for name in group["params"]}
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name, _, slot = key.rpartition("/")
        if name in known:
            slots.setdefault(name, {})[slot] = value.clone() if value.ndim == 0 else value.to(device)
        elif name not in elsewhere:
            from polytrain.checkpoint import CheckpointError

            raise CheckpointError(f"checkpoint: optimizer state for unknown parameter {name!r}")
    if slots:
        set_optimizer_state_dict(model, optimizer, {"state": slots, "param_groups": current["param_groups"]},
                                 options=options)

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

Under ``parallel`` (tensor/pipeline > 1) the same options (`shard_options`, `shard_model`) apply to the data
dimension of the layout's mesh (`data_mesh_shape`, `data_mesh`), each stage being a root
(`parallel.data.FSDPDimension`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Container, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.backend import TorchBackend, all_finite
from polytrain.adapters.torch.execution import block_modules, compile_module, find_unit_classes
from polytrain.adapters.torch.precision import check_fp16_runs
from polytrain.errors import OwnLoopError, SpecError
from polytrain.spec.tables import TrainSpec

MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RESHARD_AFTER_FORWARD = {"full_shard": True, "shard_grad_op": False, "hybrid_shard": True, "no_shard": False}
__all__ = ["FSDPBackend", "MIXED_DTYPES", "RESHARD_AFTER_FORWARD", "data_mesh", "data_mesh_shape", "find_unit_classes",
           "mesh_shape", "shard_model", "shard_options"]


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


def data_mesh_shape(sharding: str, grid: tuple[int, int, int], num_nodes: int, local_size: int) -> tuple[int, int]:
    """(replicate, shard) of the data dimension of a ``pipeline × data × tensor`` grid (`polytrain.spec.layout`), the
    strategies meaning what they mean for the whole world in `mesh_shape`: hybrid_shard shards over the data
    ranks that share a node and replicates across nodes (one node: all of them, like full_shard)."""
    pipeline, data, tensor = grid
    if sharding == "no_shard":
        return (data, 1)
    if sharding != "hybrid_shard":
        return (1, data)
    mesh_shape(sharding, pipeline * data * tensor, num_nodes, local_size)  # the same processes on every node
    span = data * tensor  # the ranks of one pipeline stage, among which each data group lies
    if local_size % span == 0:  # a node holds whole stages: every data group on one node
        return (1, data)
    if span % local_size == 0 and local_size % tensor == 0:
        return (span // local_size, local_size // tensor)
    raise SpecError(f"fsdp.sharding: hybrid_shard needs each node to hold whole tensor groups and an equal share of "
                    f"every data group; {local_size} processes per node do not fit parallel data {data} × tensor "
                    f"{tensor} (use full_shard, or a node size that divides or is divided by {span})")


def data_mesh(sharding: str, mesh: Any) -> Any:
    """The data dimension of a layout's ``dp_replicate × dp_shard`` mesh as ``fully_shard`` takes it: both
    dimensions where plain fsdp's mesh for ``sharding`` has two (`mesh_shape`: hybrid_shard, no_shard), ``dp_shard``
    alone otherwise."""
    return mesh["dp_replicate", "dp_shard"] if len(mesh_shape(sharding, 1, 1, 1)) == 2 else mesh["dp_shard"]


def check_node_major(backend: TorchBackend) -> None:
    """hybrid_shard: init_device_mesh puts ranks row by row, so each row must be one node's ranks."""
    world = backend.world
    node_major = world.rank == world.node_rank * world.local_size + world.local_rank
    if not all(backend.all_gather_object(node_major)):
        raise SpecError("fsdp.sharding: hybrid_shard needs ranks numbered node by node "
                        "(rank = node_rank × processes per node + local_rank); the launcher interleaved them")


def shard_options(spec: TrainSpec, device: torch.device, mesh: Any) -> dict[str, Any]:
    """``fully_shard``'s options from the spec's ``fsdp`` table and precision, over ``mesh``: the whole world
    for backend fsdp, the data dimension of a model-parallel layout (`parallel.backend`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    fsdp = spec.fsdp
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": RESHARD_AFTER_FORWARD[fsdp.sharding]}
    dtype = MIXED_DTYPES.get(spec.precision)
    if dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32 if fsdp.reduce_fp32 else dtype)
    if fsdp.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return options


def shard_model(model: nn.Module, spec: TrainSpec, options: Mapping[str, Any]) -> list[nn.Module]:
    """``fully_shard`` each unit (``fsdp.units``, else the model's blocks), innermost first, then ``model``.
    Returns the units."""
    from torch.distributed.fsdp import fully_shard

    units = block_modules(model, spec.fsdp.units)  # checkpointed already when asked (framework.build)
    for unit in reversed(units):  # innermost first, as fully_shard requires
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return units


class FSDPBackend(TorchBackend):
    name = "fsdp"
    traces_collectives = True  # the library issues them: the timeline records each
    alters_module = True  # fully_shard turns parameters into DTensors on the job's mesh
    binds_module_to_group = True  # ... so an elastic re-form shards a fresh module

    @property
    def in_place_refusal(self) -> str | None:
        """Every rank's commit holds the whole (gathered) state, which a re-form shards again over a fresh module
        (`elastic_group.regroup`); hybrid sharding's mesh follows the nodes, which a re-form may change."""
        if self.spec.fsdp.sharding == "hybrid_shard":
            return "fsdp.sharding: 'hybrid_shard' cannot recover in place yet; use full_shard or shard_grad_op"
        return None

    def setup(self) -> None:
        # before the group: ShardedGradScaler's `process_group=group.WORLD` default is evaluated at import, and
        # would hold the group for the life of the process (see rendezvous.import_before_group)
        import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401

        super().setup()
        self.ensure_process_group()  # one process: FSDP still needs one

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        world, sharding = self.world, self.spec.fsdp.sharding
        shape = mesh_shape(sharding, world.size, world.num_nodes, world.local_size)
        if sharding == "hybrid_shard":
            check_node_major(self)
        if len(shape) == 1:
            return init_device_mesh(self.device.type, shape, mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        from polytrain.adapters.torch.backend import rebuilt_optimizer

        names = {id(p): n for n, p in model.named_parameters()}
        self.mesh = self._mesh()
        self._units = shard_model(model, self.spec, shard_options(self.spec, self.device, self.mesh))
        self._root = weakref.ref(model)  # what an own-loop script holds after `end()` (the Trainer lets go first)
        # The given optimizer points at the replaced (unsharded) parameters: the same one over the new ones.
        return model, rebuilt_optimizer(optimizer, names, model)

    def teardown(self) -> None:
        self._units = []
        root = self._root() if getattr(self, "_root", None) is not None else None
        self._root = None
        if root is not None:  # its groups are let go of (rendezvous.let_go_of): a forward could gather no more
            root.register_forward_pre_hook(_sharded_after_the_job, prepend=True)
        super().teardown()

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
        bad = float(not all_finite(grads))
        return self.all_reduce(np.array([bad]), op="max")[0] == 0.0

    def grad_scaler(self) -> Any:
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
            from polytrain.checkpoint.store import CheckpointError

            raise CheckpointError(f"checkpoint: optimizer state for unknown parameter {name!r}")
    if slots:
        set_optimizer_state_dict(model, optimizer, {"state": slots, "param_groups": current["param_groups"]},
                                 options=options)


def _sharded_after_the_job(module: nn.Module, args: Any) -> None:
    raise OwnLoopError("forward: this module was sharded across the ranks by fsdp and the job's process group has "
                       "ended; use the model polytrain.fit returned, or in your own loop take the whole state with "
                       "dist.get_state_dict(model) before dist.end()")

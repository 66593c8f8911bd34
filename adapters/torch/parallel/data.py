"""The data dimension of a model-parallel layout: how the ranks that hold the same part of the model, one per
data shard, share their gradients. `backend.ParallelBackend` is given one; the registry row of the data backend
(``ddp``, ``fsdp``) names the layout made with it (its ``layout``), and the dimension carries that backend's
name, which checkpoints record.

- `DDPDimension`: the gradient shards averaged over the data group in one flat all-reduce after a step's last
  micro-step (DDP itself does not take DTensor parameters).
- `FSDPDimension`: each block and each stage sharded with FSDP2 over the data ranks through plain fsdp's code
  (`fsdp.data_mesh_shape`, `fsdp.shard_options`, `fsdp.shard_model`): the ``fsdp`` table (sharding, cpu_offload,
  reduce_fp32, units) means over the data dimension what it means over the world under backend ``fsdp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from polytrain.adapters.torch.backend import TorchBackend
from polytrain.observe.timeline import COLLECTIVES, Timeline
from polytrain.spec.layout import Grid
from polytrain.spec.tables import TrainSpec


class DataDimension:
    """What a layout's data dimension does at each point of the run; the defaults do nothing."""

    #: the data backend's registry name, the layout backend's ``name`` (written into checkpoints)
    name: str

    def split(self, backend: TorchBackend, grid: Grid) -> tuple[int, int]:
        """(replicate, shard): how the grid's data ranks form the mesh's ``dp_replicate`` and ``dp_shard``
        dimensions. Called on every rank alike (it may be collective)."""
        return (1, grid.data)

    def bind(self, mesh: Any) -> None:
        """The layout's ``pp × dp_replicate × dp_shard × tp`` DeviceMesh, once it is built."""

    def wrap(self, stages: list[nn.Module], spec: TrainSpec, device: torch.device, mesh: Any) -> None:
        """This rank's stages (the whole model without a pipeline), after tensor parallel and the pipeline cut."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before a step's last: gradients accumulate on each rank."""
        yield

    def sync(self, params: Iterable[nn.Parameter], timeline: Timeline) -> None:
        """After the backward pass of a step's last micro-step."""

    def release(self) -> None:
        """Let go of the groups and modules held (the backend's teardown)."""


class DDPDimension(DataDimension):
    name = "ddp"

    def __init__(self) -> None:
        self.group: Any = None
        self.size = 1

    def bind(self, mesh: Any) -> None:
        # every data rank is in dp_shard (nothing is replicated here)
        self.group, self.size = mesh["dp_shard"].get_group(), mesh["dp_shard"].size()

    def sync(self, params: Iterable[nn.Parameter], timeline: Timeline) -> None:
        if self.size == 1:
            return
        from polytrain.adapters.torch.parallel.state import average_gradients

        started = timeline.now()
        nbytes = average_gradients(params, self.group, self.size)
        timeline.complete("gradient average (data group)", "collective", started, timeline.now(), track=COLLECTIVES,
                          op="allreduce", bytes=nbytes)

    def release(self) -> None:
        self.group = None


class FSDPDimension(DataDimension):
    name = "fsdp"

    def __init__(self) -> None:
        self.sharded: list[nn.Module] = []

    def split(self, backend: TorchBackend, grid: Grid) -> tuple[int, int]:
        from polytrain.adapters.torch.fsdp import check_node_major, data_mesh_shape

        sharding = backend.spec.fsdp.sharding
        if sharding == "hybrid_shard":
            check_node_major(backend)
        return data_mesh_shape(sharding, grid.shape, backend.world.num_nodes, backend.world.local_size)

    def wrap(self, stages: list[nn.Module], spec: TrainSpec, device: torch.device, mesh: Any) -> None:
        """Each stage a root of its own."""
        from polytrain.adapters.torch.fsdp import data_mesh, shard_model, shard_options

        options = shard_options(spec, device, data_mesh(spec.fsdp.sharding, mesh))
        for stage in stages:
            shard_model(stage, spec, options)
        self.sharded = list(stages)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        for module in self.sharded:
            module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for module in self.sharded:
                module.set_requires_gradient_sync(True)

    def release(self) -> None:
        self.sharded = []

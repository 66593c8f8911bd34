"""``parallel.tensor`` / ``parallel.pipeline`` > 1: the model split over a ``pp × dp × tp`` DeviceMesh, the data
dimension run by the spec's backend (``ddp`` or ``fsdp``), the way torchtitan composes them:

1. tensor parallel first (`tensor.apply_tensor_parallel`, over ``mesh["tp"]``), on the whole model;
2. then the pipeline cut (`pipeline.cut`): the model pruned to this rank's stage(s);
3. then the data dimension over ``mesh["dp"]``: ``fsdp`` shards each block and each stage with FSDP2
   (``fully_shard``: 2-D DTensors where tensor parallel split them); ``ddp`` averages the gradient shards
   over the data-parallel group in one flat all-reduce after a step's last micro-step (DDP itself does not
   take DTensor parameters).

Checkpoints are portable: `full_state` is the whole model on every rank (see `state.py`), and
`load_full_state` takes it back in any layout.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.backend import TorchBackend
from polytrain.adapters.torch.execution import block_modules, compile_module
from polytrain.adapters.torch.parallel import state as layout_state
from polytrain.adapters.torch.parallel.tensor import from_portable, to_portable
from polytrain.layout import DATA_BACKENDS, grid_for
from polytrain.protocols import DataShard
from polytrain.spec import TrainSpec
from polytrain.timeline import COLLECTIVES, NULL, Timeline
from polytrain.watchdog import Activity
from polytrain.world import World


class ParallelBackend(TorchBackend):
    traces_collectives = True  # DTensor, the pipeline and FSDP issue them: the timeline records each

    def __init__(self, spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
                 activity: Activity | None = None) -> None:
        super().__init__(spec, world, timeline=timeline, activity=activity)
        self.grid = grid_for(spec.parallel, world.size, world.rank)
        self.name = spec.backend if spec.backend in DATA_BACKENDS else "ddp"
        self.data_shard = DataShard(self.grid.data, self.grid.data_rank, self.grid.reports)
        self.pipeline: Any = None
        self.head_major: dict[str, int] = {}
        self._sync = True

    @property
    def label(self) -> str:
        p, d, t = self.grid.shape
        return f"{self.name} × tensor {t} × pipeline {p} (data {d}; mesh pp×dp×tp)"

    def setup(self) -> None:
        super().setup()
        self.ensure_process_group()
        from torch.distributed.device_mesh import init_device_mesh

        # DTensor's advice to flatten mesh dimensions (a 2-D gradient norm under fsdp × tensor) is for its
        # authors, not for a user: keep it out of the job's output
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.mesh = init_device_mesh(self.device.type, self.grid.shape, mesh_dim_names=("pp", "dp", "tp"))
        self.pp_group = self.mesh["pp"].get_group() if self.grid.pipeline > 1 else None
        self.dp_group = self.mesh["dp"].get_group()

    def bind_data(self, info: Any) -> None:
        self.info = info

    # ---------------------------------------------------------------- building the layout
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        from polytrain.adapters.torch.framework import make_optimizer

        parallel = self.spec.parallel
        self.order = list(model.state_dict().keys())
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        example = None
        if parallel.pipeline > 1:
            from polytrain.adapters.torch.parallel.pipeline import example_input

            example = example_input(self.info).to(self.device)
        if parallel.tensor > 1:
            from polytrain.adapters.torch.parallel.tensor import apply_tensor_parallel

            self.head_major = apply_tensor_parallel(self.spec, model, self.mesh["tp"])
        stages: list[nn.Module] = [model]
        if parallel.pipeline > 1:
            from polytrain.adapters.torch.parallel.pipeline import cut
            from polytrain.adapters.torch.parallel.runner import PipelineRunner

            assert example is not None
            placed = cut(self.spec, model, example, self.grid.stage)
            total = parallel.pipeline * parallel.chunks
            stages = [module for _, module in placed]
            self.pipeline = PipelineRunner(placed, total, parallel.schedule, parallel.n_microbatches, self.device,
                                           self.pp_group, self.timeline)
        self._stages, self._model = stages, model
        if self.name == "fsdp":
            self._shard(model, stages)
        return model, make_optimizer(self.spec.optimizer, model.parameters())

    def _shard(self, model: nn.Module, stages: list[nn.Module]) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh["dp"]
        for stage in stages:
            for unit in reversed(block_modules(stage, self.spec.fsdp.units)):
                fully_shard(unit, mesh=mesh)
            fully_shard(stage, mesh=mesh)

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """Each of this rank's blocks (torchtitan's per-block compile): the tensor-parallel collectives and
        the pipeline's sends stay outside the compiled regions."""
        for stage in self._stages:
            for block in block_modules(stage, None):
                compile_module(block, mode)

    # ---------------------------------------------------------------- the step
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._sync, previous = False, self._sync
        fsdp = [m for m in self._stages if hasattr(m, "set_requires_gradient_sync")]
        for module in fsdp:
            module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._sync = previous
            for module in fsdp:
                module.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.after_backward()

    def after_backward(self) -> None:
        """After a micro-step's backward (or pipeline step): ``ddp`` averages over the data group on the last."""
        if self._sync and self.name == "ddp" and self.grid.data > 1:
            started = self.timeline.now()
            nbytes = layout_state.average_gradients(self._model.parameters(), self.dp_group, self.grid.data)
            self.timeline.complete("gradient average (data group)", "collective", started, self.timeline.now(),
                                   track=COLLECTIVES, op="allreduce", bytes=nbytes)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return layout_state.clip_gradients(list(model.parameters()), max_norm, self.pp_group)

    def grads_finite(self, model: nn.Module) -> bool:
        grads = [layout_state.local(p.grad) for p in model.parameters() if p.grad is not None]
        bad = float(any(not bool(torch.isfinite(g).all()) for g in grads if g.numel()))
        return self.all_reduce(np.array([bad]), op="max")[0] == 0.0

    def grad_scaler(self) -> Any | None:
        if self.spec.precision != "fp16":
            return None
        from polytrain.errors import SpecError

        raise SpecError("precision: fp16 (a dynamic loss scaler) does not combine with parallel.tensor/pipeline "
                        "here; use bf16 or fp32")

    def parameter_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """The whole model's shapes (recorded before it was split): the same on every rank."""
        return dict(self.shapes)

    # ---------------------------------------------------------------- portable state
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        mine = layout_state.full_tensors(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        return layout_state.gather_stages(to_portable(mine, self.head_major), self.pp_group, self.order)

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        mine = set(model.state_dict().keys())
        part = {k: v.to(self.device) for k, v in from_portable(state, self.head_major).items() if k in mine}
        set_model_state_dict(model, part, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        mine = layout_state.full_tensors({f"{name}/{key}": value for name, slots in osd["state"].items()
                                          for key, value in slots.items()})
        return layout_state.gather_stages(to_portable(mine, self.head_major), self.pp_group, self.order)

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        from polytrain.adapters.torch.fsdp import load_optimizer_state_dcp

        # another stage's parameters are another rank's
        load_optimizer_state_dcp(model, optimizer, from_portable(state, self.head_major), self.device,
                                 elsewhere=self.shapes)

"""``parallel.tensor`` / ``parallel.pipeline`` > 1: the model split over a ``pp × dp × tp`` DeviceMesh, the data
dimension run by the spec's backend (``ddp`` or ``fsdp``), the way torchtitan composes them:

1. tensor parallel first (`tensor.apply_tensor_parallel`, over ``mesh["tp"]``), on the whole model;
2. then the pipeline cut (`pipeline.cut`): the model pruned to this rank's stage(s);
3. then the data dimension (``mesh["dp_replicate", "dp_shard"]``), a `data.DataDimension` the backend is given:
   `data.FSDPDimension` shards each block and each stage with FSDP2 through plain fsdp's code (2-D DTensors where
   tensor parallel split them); `data.DDPDimension` averages the gradient shards over the data group after a
   step's last micro-step.

The registry rows of ``ddp`` and ``fsdp`` name `ddp_layout` and `fsdp_layout` (their ``layout``): the backend made
for a spec with ``parallel`` is one of these, named like its data dimension. A micro-step runs through the
pipeline's schedule where there is one (`train_micro_step`, `eval_outputs`), as the data-parallel step otherwise.

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

from polytrain.adapters.torch.backend import LossSum, TorchBackend, all_finite
from polytrain.adapters.torch.execution import block_modules, compile_module
from polytrain.adapters.torch.parallel import state as layout_state
from polytrain.adapters.torch.parallel.data import DataDimension, DDPDimension, FSDPDimension
from polytrain.adapters.torch.parallel.tensor import from_portable, to_portable
from polytrain.observe.timeline import COLLECTIVES, NULL, Timeline
from polytrain.observe.watchdog import Activity
from polytrain.protocols import DataShard
from polytrain.spec.layout import grid_for
from polytrain.spec.tables import TrainSpec
from polytrain.world import World


class ParallelBackend(TorchBackend):
    traces_collectives = True  # DTensor, the pipeline and FSDP issue them: the timeline records each
    alters_module = True  # DTensor plans and the pipeline cut remake the module
    #: a live ``parallel.tensor_plan`` function (the own-loop API's), used in place of importing the spec's name
    tensor_plan: Any = None

    def __init__(self, spec: TrainSpec, world: World, data: DataDimension, *, timeline: Timeline = NULL,
                 activity: Activity | None = None) -> None:
        super().__init__(spec, world, timeline=timeline, activity=activity)
        self.grid = grid_for(spec.parallel, world.size, world.rank)
        self.data = data
        self.name = data.name
        self.data_shard = DataShard(self.grid.data, self.grid.data_rank, self.grid.reports)
        self.pipeline: Any = None
        self.head_major: dict[str, int] = {}
        #: a tied weight of the first and the last stage, held as two copies: {last-stage name: first-stage name}
        #: (`pipeline.tied_weights`); their gradients summed over ``_tied_group`` (None: both copies on this rank)
        self.tied: dict[str, str] = {}
        self._tied_params: list[nn.Parameter] = []
        self._copies: set[int] = set()
        self._tied_group: Any = None
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
        pipeline, _, tensor = self.grid.shape
        replicate, shard = self.data.split(self, self.grid)
        self.mesh = init_device_mesh(self.device.type, (pipeline, replicate, shard, tensor),
                                     mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        self.pp_group = self.mesh["pp"].get_group() if self.grid.pipeline > 1 else None
        self.data.bind(self.mesh)

    def teardown(self) -> None:
        self.pipeline = self.pp_group = self._tied_group = None  # the stages and the groups they use
        self._tied_params = []
        self.data.release()
        super().teardown()

    def bind_data(self, info: Any) -> None:
        self.info = info

    # ---------------------------------------------------------------- building the layout
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Split ``model`` in place (see the module's docstring); ``optimizer`` (its class and its groups'
        settings) rebuilt over this rank's parameters as they are now, its state empty."""
        parallel = self.spec.parallel
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):  # a tied weight under each name
            names.setdefault(id(param), []).append(name)
        self.order = list(model.state_dict().keys())
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        example = None
        if parallel.pipeline > 1:
            from polytrain.adapters.torch.parallel.pipeline import example_input

            example = example_input(self.info).to(self.device)
        if parallel.tensor > 1:
            from polytrain.adapters.torch.parallel.tensor import apply_tensor_parallel

            self.head_major = apply_tensor_parallel(self.spec, model, self.mesh["tp"], self.tensor_plan)
        stages: list[nn.Module] = [model]
        if parallel.pipeline > 1:
            from polytrain.adapters.torch.parallel.pipeline import cut
            from polytrain.adapters.torch.parallel.runner import PipelineRunner

            assert example is not None
            total = parallel.pipeline * parallel.chunks
            self._split_tied(model, example, parallel.stage_rank(total - 1) != parallel.stage_rank(0))
            placed = cut(self.spec, model, example, self.grid.stage)
            stages = [module for _, module in placed]
            self.pipeline = PipelineRunner(placed, total, parallel.schedule, parallel.n_microbatches, self.device,
                                           self.pp_group, self.timeline)
        self._stages, self._model = stages, model
        self.data.wrap(stages, self.spec, self.device, self.mesh)
        held = dict(model.named_parameters())
        self._tied_params = [held[name] for copy, owner in sorted(self.tied.items(), key=lambda item: item[1])
                             for name in (copy, owner) if name in held]
        self._copies = {id(held[copy]) for copy in self.tied if copy in held}  # counted once in the norm
        return model, _rebuilt_optimizer(optimizer, names, model)

    def _split_tied(self, model: nn.Module, example: torch.Tensor, two_ranks: bool) -> None:
        """Two copies of each tied weight: one per rank where the first and last stage are on two (the cut leaves
        each its own), both on one rank otherwise (V-shaped schedules: the copy made here, so that each stage's
        FSDP unit owns its parameters)."""
        from polytrain.adapters.torch.parallel.pipeline import tied_weights

        self.tied = tied_weights(model, example)
        if self.tied and two_ranks:
            self._tied_group = layout_state.tied_group(self.mesh, self.pp_group)
        elif self.tied:
            for copy in self.tied:
                owner, _, leaf = copy.rpartition(".")
                module = model.get_submodule(owner)
                setattr(module, leaf, nn.Parameter(getattr(module, leaf).detach().clone()))

    def _sum_tied(self) -> None:
        """The step's gradient of each tied weight: the sum of its two copies' (first and last stage)."""
        if not self._tied_params:
            return
        started = self.timeline.now()
        nbytes = layout_state.sum_tied_gradients(self._tied_params, self._tied_group)
        self.timeline.complete("tied weights (first + last stage)", "collective", started, self.timeline.now(),
                               track=COLLECTIVES, op="allreduce", bytes=nbytes)

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
        try:
            with self.data.no_sync():
                yield
        finally:
            self._sync = previous

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync:  # the step's last micro-step
            self.data.sync(self._model.parameters(), self.timeline)

    def train_micro_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_sum: LossSum, scale: float,
                         sync: bool, autocast: contextlib.AbstractContextManager[Any], scaler: Any | None) -> float:
        """With a pipeline, its schedule runs the forward and backward passes of every micro-batch of its stages
        (the summed loss on the last stage, 0 elsewhere); without one, the data-parallel step."""
        if self.pipeline is None:
            return super().train_micro_step(model, x, y, loss_sum, scale, sync, autocast, scaler)
        with contextlib.nullcontext() if sync else self.no_sync(model):
            loss = self.pipeline.train(x, y, loss_sum, scale, autocast)
        if sync:
            self.data.sync(self._model.parameters(), self.timeline)
            self._sum_tied()
        return loss

    def eval_outputs(self, model: nn.Module, x: torch.Tensor,
                     autocast: contextlib.AbstractContextManager[Any]) -> torch.Tensor | None:
        if self.pipeline is None:
            return super().eval_outputs(model, x, autocast)
        return self.pipeline.forward(x, autocast)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return layout_state.clip_gradients(list(model.parameters()), max_norm, self.pp_group, self._copies)

    def grads_finite(self, model: nn.Module) -> bool:
        grads = [layout_state.local(p.grad) for p in model.parameters() if p.grad is not None]
        bad = float(not all_finite(grads))
        return self.all_reduce(np.array([bad]), op="max")[0] == 0.0

    def grad_scaler(self) -> Any:
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
        state = {**{copy: state[owner] for copy, owner in self.tied.items() if owner in state}, **state}
        part = {k: v.to(self.device) for k, v in from_portable(state, self.head_major).items() if k in mine}
        set_model_state_dict(model, part, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        # a tied weight's second copy holds the first's state: one process has it once, under the first name
        mine = layout_state.full_tensors({f"{name}/{key}": value for name, slots in osd["state"].items()
                                          if name not in self.tied for key, value in slots.items()})
        return layout_state.gather_stages(to_portable(mine, self.head_major), self.pp_group, self.order)

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        from polytrain.adapters.torch.fsdp import load_optimizer_state_dcp

        state = dict(state)
        for copy, owner in self.tied.items():  # the copy's state is the first-stage weight's
            state.update({f"{copy}/{key.rpartition('/')[2]}": value for key, value in list(state.items())
                          if key.rpartition("/")[0] == owner})
        # another stage's parameters are another rank's
        load_optimizer_state_dcp(model, optimizer, from_portable(state, self.head_major), self.device,
                                 elsewhere=self.shapes)


def _rebuilt_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, list[str]],
                       model: nn.Module) -> torch.optim.Optimizer:
    """`backend.rebuilt_optimizer` for a layout: the parameters another pipeline stage holds (gone from this
    rank's pruned model) are left out of their groups; every group stays, so group indices keep their meaning. A
    tied weight is found under each of its names this rank still holds (two copies, or one)."""
    now = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        found = {id(now[n]): now[n] for p in group["params"] for n in names.get(id(p), []) if n in now}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(found.values())})
    return type(optimizer)(groups)



def ddp_layout(spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
               activity: Activity | None = None) -> ParallelBackend:
    """A model-parallel layout with ``ddp`` as its data dimension (registry row ``ddp``'s ``layout``)."""
    return ParallelBackend(spec, world, DDPDimension(), timeline=timeline, activity=activity)


def fsdp_layout(spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
                activity: Activity | None = None) -> ParallelBackend:
    """A model-parallel layout with ``fsdp`` as its data dimension (registry row ``fsdp``'s ``layout``)."""
    return ParallelBackend(spec, world, FSDPDimension(), timeline=timeline, activity=activity)

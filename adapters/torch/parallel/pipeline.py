"""Pipeline parallelism: the model's blocks cut into stages that run on the ranks of the ``pp`` mesh
dimension, driven by ``torch.distributed.pipelining``'s schedules (GPipe, 1F1B, interleaved 1F1B).

**Where the model is cut.** A model that can be pipelined declares its repeated blocks (``block_classes``,
as for FSDP units and activation checkpointing) and two methods: ``embed(x)`` — everything before the first
block — and ``finish(h)`` — everything after the last — so that ``forward(x)`` is ``finish(blocks(embed(x)))``.
The modules ``embed`` uses (found by running it once on an example input) go to the first stage, every other
module outside the blocks to the last. Stages hold consecutive blocks, balanced by parameter count or cut at
``parallel.stage_boundaries``. With ``stages_per_rank`` (interleaved schedules) there are ``P × V`` stages and
stage ``s`` runs on pipeline rank ``s mod P``; the V-shaped schedules (``zbv``, ``dualpipev``) put stages ``r``
and ``2P − 1 − r`` on rank ``r`` (`ParallelSpec.stage_rank`). A weight shared by the first and the last stage (a tied input
embedding and output head) is held as two copies, one per stage, their gradients summed every step
(`tied_weights`; the backend's ``sum_tied_gradients``).

**What a rank keeps.** The model object itself, pruned: blocks of other stages become ``nn.Identity`` and
first/last-stage modules of other ranks are removed, so parameter names stay those of the whole model
(checkpoints, optimizer state and FSDP all see global names). Each stage is a `StageModule` sharing the
model's submodules.

**Micro-batches and accumulation.** Each micro-step's batch (``data.batch_size`` samples of a data shard) is
split into ``parallel.microbatches`` pipeline micro-batches (default ``P``); ``loop.grad_accum_steps`` still
counts micro-steps per optimizer step. A micro-batch's loss is its summed sample loss times the Trainer's
scale (``scale_grads=False``), so gradients are the exact mean over the step's samples, as on every backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polytrain.adapters.torch.execution import block_modules
from polytrain.errors import SpecError
from polytrain.spec.layout import balanced_boundaries, cannot_pipeline, check_blocks
from polytrain.spec.tables import TrainSpec


def embed_modules(model: nn.Module, example: torch.Tensor) -> set[str]:
    """Names of the top-level submodules that ``model.embed`` uses, found by running it once."""
    if not (callable(getattr(model, "embed", None)) and callable(getattr(model, "finish", None))):
        raise cannot_pipeline(type(model).__name__)
    used: set[str] = set()
    handles = [child.register_forward_pre_hook(lambda module, args, name=name: used.add(name))
               for name, child in model.named_children()]
    try:
        with torch.no_grad():
            model.embed(example)
    finally:
        for handle in handles:
            handle.remove()
    return used


def block_paths(model: nn.Module, spec: TrainSpec) -> list[str]:
    """Dotted names of the model's blocks, in order (outermost blocks only)."""
    blocks = block_modules(model, None)
    names = {id(module): name for name, module in model.named_modules()}
    paths: list[str] = []
    for block in blocks:
        path = names[id(block)]
        if not any(path.startswith(f"{outer}.") for outer in paths):
            paths.append(path)
    if not paths:
        raise SpecError(f"parallel.pipeline: model {type(model).__name__} declares no blocks (block_classes) to cut "
                        "into stages")
    return paths


def stage_ranges(spec: TrainSpec, model: nn.Module, paths: list[str], first: set[str]) -> list[range]:
    """The block indices of each stage (``P × stages_per_rank`` stages)."""
    parallel = spec.parallel
    stages = parallel.pipeline * parallel.chunks
    check_blocks(parallel, len(paths), f"{type(model).__name__}'s block_classes")
    if parallel.stage_boundaries is not None:
        cuts = parallel.stage_boundaries
    else:
        modules = dict(model.named_modules())
        sizes = [sum(p.numel() for p in modules[path].parameters()) for path in paths]
        ends = sum(p.numel() for name, child in model.named_children() if name in first for p in child.parameters())
        sizes[0] += ends
        cuts = balanced_boundaries(sizes, stages)
    edges = (0, *cuts, len(paths))
    return [range(edges[i], edges[i + 1]) for i in range(stages)]


class StageModule(nn.Module):
    """One pipeline stage: some of the model's blocks (under their own names), plus ``embed`` on the first
    stage and ``finish`` on the last, sharing the model's submodules."""

    def __init__(self, model: nn.Module, paths: list[str], first: bool, last: bool, ends: list[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: its other parts are not this stage's
        self.first, self.last, self.paths = first, last, paths
        for name in ends:
            setattr(self, name, getattr(model, name))
        modules = dict(model.named_modules())
        for path in paths:
            parent: nn.Module = self
            *outer, leaf = path.split(".")
            for part in outer:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, modules[path])
        self._blocks = [modules[path] for path in paths]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self._model.embed(x)
        for block in self._blocks:
            x = block(x)
        if self.last:
            x = self._model.finish(x)
        return x


def cut(spec: TrainSpec, model: nn.Module, example: torch.Tensor, pp_rank: int) -> list[tuple[int, StageModule]]:
    """Prune ``model`` to this pipeline rank's stages (see the module's docstring); returns (stage index, stage).
    A weight the first and the last stage share (`tied_weights`) ends as one copy on each of their two ranks (on a
    rank holding both, the backend has made the second copy before the cut)."""
    parallel = spec.parallel
    paths = block_paths(model, spec)
    check_blocks(parallel, len(paths), f"{type(model).__name__}'s block_classes")
    first = embed_modules(model, example)
    block_roots = {path.split(".")[0] for path in paths}
    last = [name for name, _ in model.named_children() if name not in first and name not in block_roots]
    if model._parameters and any(p is not None for p in model._parameters.values()):
        raise SpecError(f"parallel.pipeline: {type(model).__name__} has parameters of its own "
                        f"({', '.join(model._parameters)}); keep them in submodules so a stage can own them")
    ranges = stage_ranges(spec, model, paths, first)
    total = len(ranges)
    mine = [s for s in range(total) if parallel.stage_rank(s) == pp_rank]
    stages = [(s, StageModule(model, [paths[i] for i in ranges[s]], s == 0, s == total - 1,
                              (sorted(first) if s == 0 else []) + (last if s == total - 1 else [])))
              for s in mine]
    kept = {paths[i] for s in mine for i in ranges[s]}
    modules = dict(model.named_modules())
    for path in paths:
        if path not in kept:
            *outer, leaf = path.split(".")
            parent = modules[".".join(outer)] if outer else model
            setattr(parent, leaf, nn.Identity())
    for name in first if 0 not in mine else ():
        setattr(model, name, None)
    for name in last if total - 1 not in mine else ():
        setattr(model, name, None)
    return stages


def tied_weights(model: nn.Module, example: torch.Tensor) -> dict[str, str]:
    """The weights a last-stage module shares with a first-stage one (the transformer's tied head), as
    {last-stage name: first-stage name}, found on the whole model before `cut`. Under pipeline parallel each of
    the two stages' ranks keeps its own copy (Megatron's way): `sum_tied_gradients` adds the copies' gradients
    every step, so both take the same update and stay equal."""
    first = embed_modules(model, example)
    names = {id(module): name for name, module in model.named_modules()}
    block_roots = {names[id(block)].split(".")[0] for block in block_modules(model, None)}  # none: no blocks
    owners = {id(p): f"{name}.{pname}" for name in sorted(first)
              for pname, p in getattr(model, name).named_parameters(remove_duplicate=False)}
    return {f"{name}.{pname}": owners[id(p)] for name, child in model.named_children()
            if name not in first and name not in block_roots
            for pname, p in child.named_parameters(remove_duplicate=False) if id(p) in owners}


def example_input(info: Any) -> torch.Tensor:
    """A one-sample input of the data's shape (token ids for next-token data), for `embed_modules`."""
    dtype = torch.long if info.task == "next_token" else torch.float32
    return torch.zeros((1, *info.input_shape), dtype=dtype)

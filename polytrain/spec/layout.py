"""Model-parallel layouts (spec ``parallel``): how tensor, pipeline and data parallelism share the ranks.

``parallel: {tensor: T, pipeline: P, data: auto, microbatches: M, schedule: 1f1b}`` splits the world
into a 3-D grid of ``P × D × T`` ranks, ``D = world_size / (T × P)`` (``data: auto``), in the order
torchtitan and Megatron-LM use: **tensor parallel is innermost** — a tensor-parallel group is ``T``
consecutive ranks, which launchers place on one node, so its many per-layer collectives stay on the
fastest link — then data, then pipeline stages outermost (stage ``s`` holds ranks
``s·D·T … (s+1)·D·T − 1``). The data dimension is the spec's backend, one whose registry row names a
``layout`` (``ddp`` or ``fsdp``); the other backends do not combine with ``T`` or ``P`` > 1.

Everything here is pure (no torch): the spec's table, its rules, and a rank's place in the grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import SpecError
from polytrain.spec.schema import rule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
#: schedules that run several model chunks (stages) per rank; the V-shaped ones exactly two, rank r holding
#: stages r and 2P − 1 − r (so the first and the last stage share rank 0)
MULTI_CHUNK = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
#: schedules that split each backward into its input and its weight half (torch cannot compile those)
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv", "dualpipev")


@dataclass(frozen=True)
class ParallelSpec:
    """Tensor, pipeline and data parallel degrees (PyTorch only; see this module's docstring)."""

    tensor: int = rule(1, min=1)  # T: each layer's weights split across T ranks (Megatron-style)
    pipeline: int = rule(1, min=1)  # P: the model's blocks split into P stages
    data: int | str = "auto"  # D: auto = world_size / (T × P); a number is checked against that
    # pipeline micro-batches per micro-step (each micro-step's batch of data.batch_size samples is split
    # into M); null: P (the least that fills the pipeline once)
    microbatches: int | None = rule(None, min=1)
    schedule: str = rule("1f1b", choices=SCHEDULES)
    # interleaved schedules: model chunks (virtual stages) per rank; null: 2 for those (zbv and dualpipev: always
    # 2, V-shaped), else 1
    stages_per_rank: int | None = rule(None, min=1)
    # package.module:function(model, tp_mesh) -> the parallelize_module plan {submodule name: ParallelStyle}
    # (null: the model's own — the zoo transformer has one)
    tensor_plan: str | None = None
    # block index where each stage after the first starts (P × stages_per_rank − 1 numbers, increasing);
    # null: balanced by parameter count
    stage_boundaries: tuple[int, ...] | None = None

    @property
    def model_parallel(self) -> bool:
        return self.tensor > 1 or self.pipeline > 1

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (more than one only for interleaved schedules)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule in MULTI_CHUNK else 1

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``: round robin (stage s on s mod P), or V-shaped."""
        if self.schedule in V_SHAPED and stage >= self.pipeline:
            return 2 * self.pipeline - 1 - stage
        return stage % self.pipeline

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pipeline


def check_spec(parallel: ParallelSpec, *, framework: str, backend: str, data_backends: Sequence[str],
               batch_size: int | None) -> None:
    """The rules of the ``parallel`` table that need no World (one line each, naming the field). ``data_backends``:
    the backends that can be a layout's data dimension (`polytrain.registry.layout_backends`)."""
    if isinstance(parallel.data, str) and parallel.data != "auto":
        raise SpecError(f"parallel.data: expected auto or a positive integer, got {parallel.data!r}")
    if not isinstance(parallel.data, str) and parallel.data < 1:
        raise SpecError(f"parallel.data: expected auto or a positive integer, got {parallel.data!r}")
    pipeline_only = {"microbatches": parallel.microbatches is not None,
                     "schedule": parallel.schedule != "1f1b", "stages_per_rank": parallel.stages_per_rank is not None,
                     "stage_boundaries": parallel.stage_boundaries is not None}
    for name, given in pipeline_only.items():
        if given and parallel.pipeline == 1:
            raise SpecError(f"parallel.{name}: only used with parallel.pipeline > 1")
    if parallel.tensor_plan is not None and parallel.tensor == 1:
        raise SpecError("parallel.tensor_plan: only used with parallel.tensor > 1")
    if not parallel.model_parallel:
        return
    which = "parallel.tensor" if parallel.tensor > 1 else "parallel.pipeline"
    if framework != "torch":
        raise SpecError(f"{which}: tensor and pipeline parallel are PyTorch-only here (built on torch's DeviceMesh, "
                        f"DTensor and torch.distributed.pipelining; TensorFlow has no maintained equivalent); "
                        f"use framework 'torch' or set {which}: 1")
    if backend not in (*data_backends, "auto"):
        raise SpecError(f"{which}: combines with backend {' or '.join(data_backends)} (the data-parallel "
                        f"dimension), not {backend!r}")
    if parallel.chunks > 1 and parallel.schedule not in MULTI_CHUNK:
        raise SpecError(f"parallel.stages_per_rank: more than one model chunk per rank needs schedule "
                        f"{', '.join(MULTI_CHUNK)}, not {parallel.schedule!r}")
    if parallel.schedule == "interleaved_1f1b" and parallel.chunks < 2:
        raise SpecError("parallel.stages_per_rank: schedule interleaved_1f1b needs 2 or more chunks per rank")
    if parallel.schedule in V_SHAPED and parallel.chunks != 2:
        raise SpecError(f"parallel.stages_per_rank: schedule {parallel.schedule} runs exactly 2 chunks per rank "
                        f"(V-shaped), not {parallel.chunks}")
    if parallel.schedule in ZERO_BUBBLE and backend == "fsdp":
        raise SpecError(f"parallel.schedule: {parallel.schedule} with backend fsdp loses weight gradients in torch's "
                        "pipelining (its split backward runs past FSDP's gradient reduction: the last stage's come out "
                        "empty); use backend ddp for the data dimension, or schedule interleaved_1f1b with fsdp")
    if parallel.schedule == "dualpipev" and parallel.n_microbatches < 2 * parallel.pipeline:
        raise SpecError(f"parallel.microbatches: schedule dualpipev needs at least as many micro-batches as stages "
                        f"({2 * parallel.pipeline}), got {parallel.n_microbatches}")
    if parallel.pipeline > 1 and batch_size is not None and batch_size % parallel.n_microbatches:
        raise SpecError(f"parallel.microbatches: {parallel.n_microbatches} must divide data.batch_size "
                        f"{batch_size} (each micro-step's batch is split into that many pipeline micro-batches)")
    boundaries = parallel.stage_boundaries
    if boundaries is not None:
        stages = parallel.pipeline * parallel.chunks
        if len(boundaries) != stages - 1:
            raise SpecError(f"parallel.stage_boundaries: {stages} stages need {stages - 1} boundaries (the block "
                            f"index where each stage after the first starts), got {len(boundaries)}")
        if any(b <= a for a, b in zip((0, *boundaries), boundaries)):
            raise SpecError(f"parallel.stage_boundaries: must increase and start above 0, got {list(boundaries)}")


def check_model(parallel: ParallelSpec, name: str, params: Mapping[str, Any]) -> None:
    """What a zoo model's parameters already say about the layout: its blocks, its tensor-parallel plan.

    A factory's model is known only when built: the same lines come from `check_blocks`, `no_tensor_plan`
    and `cannot_pipeline` then, on every rank alike."""
    from polytrain.spec import zoo as zoo

    if not parallel.model_parallel or name not in zoo.ZOO:
        return
    params_obj = zoo.model_params(name, params)
    if isinstance(params_obj, zoo.TransformerParams):
        check_transformer(parallel, params_obj.n_heads, params_obj.d_ff or 4 * params_obj.d_model)
        check_blocks(parallel, params_obj.n_layers, "model.params.n_layers")
        return
    if parallel.tensor > 1 and parallel.tensor_plan is None:
        raise no_tensor_plan(repr(name))
    if parallel.pipeline > 1:
        raise cannot_pipeline(repr(name))


def check_blocks(parallel: ParallelSpec, blocks: int, source: str) -> None:
    """Pipeline stages against the model's ``blocks`` (``source`` says where that number comes from)."""
    stages = parallel.pipeline * parallel.chunks
    if stages > blocks:
        per_rank = f" ({parallel.pipeline} × {parallel.chunks} per rank)" if parallel.chunks > 1 else ""
        raise SpecError(f"parallel.pipeline: {stages} stages{per_rank} need at least {stages} blocks; the model "
                        f"declares {blocks} ({source}); use fewer stages or a deeper model")
    boundaries = parallel.stage_boundaries
    if boundaries is not None and boundaries[-1] >= blocks:
        raise SpecError(f"parallel.stage_boundaries: {list(boundaries)} cut past the model's {blocks} blocks "
                        f"({source}); each boundary must be below {blocks}")


def no_tensor_plan(model: str) -> SpecError:
    return SpecError(f"parallel.tensor: model {model} has no tensor-parallel plan built in; give "
                     "parallel.tensor_plan: package.module:function returning its parallelize_module plan")


def cannot_pipeline(model: str) -> SpecError:
    return SpecError(f"parallel.pipeline: model {model} cannot be cut into stages: it needs block_classes and the "
                     "methods embed(x) (before the first block) and finish(h) (after the last); use model "
                     "'transformer' or such a factory")


def check_transformer(parallel: ParallelSpec, n_heads: int, d_ff: int) -> None:
    """The zoo transformer's own limits, known before any process starts."""
    if parallel.tensor > 1 and n_heads % parallel.tensor:
        raise SpecError(f"parallel.tensor: {parallel.tensor} does not divide the transformer's {n_heads} attention "
                        "heads (model.params.n_heads); each rank computes whole heads")
    if parallel.tensor > 1 and d_ff % parallel.tensor:
        raise SpecError(f"parallel.tensor: {parallel.tensor} does not divide the MLP width {d_ff} (model.params.d_ff)")


@dataclass(frozen=True)
class Grid:
    """A rank's place in the ``pipeline × data × tensor`` grid."""

    pipeline: int
    data: int
    tensor: int
    rank: int
    last_stage: int | None = None  # the pipeline rank running the last stage (None: the last rank)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pipeline, self.data, self.tensor)

    @property
    def stage(self) -> int:
        return self.rank // (self.data * self.tensor)

    @property
    def data_rank(self) -> int:
        return self.rank // self.tensor % self.data

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def reports(self) -> bool:
        """Whether this rank's loss and metric sums stand for its data shard (tensor rank 0 of the last stage)."""
        return self.tensor_rank == 0 and self.stage == (self.pipeline - 1 if self.last_stage is None
                                                         else self.last_stage)


def grid_for(parallel: ParallelSpec, world_size: int, rank: int) -> Grid:
    """The grid of ``world_size`` ranks; a one-line error when the degrees do not divide it."""
    t, p = parallel.tensor, parallel.pipeline
    if world_size % (t * p):
        raise SpecError(f"parallel: tensor {t} × pipeline {p} = {t * p} does not divide the world size {world_size}; "
                        f"start a multiple of {t * p} processes or change parallel.tensor/parallel.pipeline")
    data = world_size // (t * p)
    if parallel.data != "auto" and parallel.data != data:
        raise SpecError(f"parallel.data: {parallel.data} × tensor {t} × pipeline {p} must equal the world size "
                        f"{world_size} (data would be {data}); set parallel.data: auto")
    return Grid(pipeline=p, data=data, tensor=t, rank=rank, last_stage=parallel.stage_rank(p * parallel.chunks - 1))


def balanced_boundaries(sizes: list[int], stages: int) -> tuple[int, ...]:
    """Where each stage after the first starts, so that stages hold about equal numbers of parameters.

    ``sizes``: the parameter count of each block, in order (the embedding and head count with the first
    and last block). Every stage gets at least one block."""
    if len(sizes) < stages:
        raise SpecError(f"parallel.pipeline: {stages} stages need at least {stages} blocks; the model declares "
                        f"{len(sizes)}")
    total, starts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        wanted = len(starts) + 1
        left_blocks, left_stages = len(sizes) - (i + 1), stages - wanted
        if wanted < stages and (acc >= total * wanted / stages or left_blocks == left_stages):
            starts.append(i + 1)
    return tuple(starts)

"""Per-rank memory of a layout: parameters, gradients, optimizer state, master copies, activations and the largest
temporary buffers, from a `polytrain.plan.census.Census`. Pure arithmetic (no framework imported).

What each backend holds, as polytrain runs it (the formulas the bench and the tests check):

- ``ddp``: every rank the whole model: fp32 parameters and gradients (autocast makes bf16/fp16 copies during
  the forward, which the traced activations contain), the optimizer state, and DDP's gradient buckets (a second
  copy of the gradients, ``gradient_as_bucket_view`` off).
- ``fsdp`` (FSDP2): parameters, gradients and optimizer state sharded over the shard group, each parameter's
  first dimension padded to a multiple of the group (``ceil(d0 / S) × rest`` per rank); the unsharded parameters
  of a unit (in the compute dtype) exist while it runs: the largest unit and the next one prefetched
  (``full_shard``, ``hybrid_shard``), or every unit from forward to backward (``shard_grad_op``); the reduce-scatter
  input of the largest unit; with gradient accumulation every unit's unsharded gradient (in the reduce dtype)
  between micro-steps, gradient sync being off. ``cpu_offload`` moves the sharded states to the host.
- ``deepspeed`` ZeRO-1/2: the whole low-precision (or fp32) model on every rank; the flat parameter vector padded
  and cut into equal partitions, each rank the optimizer state (and, under bf16/fp16, an fp32 master copy) of its
  partition. Gradients: the whole gradient of every parameter that reaches into the rank's partition (DeepSpeed
  keeps views of them), in the model's precision; under bf16/fp16 the optimizer step adds the fp32 gradient
  partition (a temporary). In fp32 without offload polytrain shares the master partition with the model's.
- ``deepspeed`` ZeRO-3: each parameter partitioned on its own (``ceil(n / D)``), parameters below
  ``stage3_param_persistence_threshold`` elements also kept whole; gradients (in the model's precision; the fp32
  copy made for the step a temporary) and optimizer state of the partition; while a module runs, its gathered
  parameters and their gradients (the largest module's), and the gathered parameters DeepSpeed keeps from forward
  to backward (within ``stage3_max_reuse_distance``).
- offload (ZeRO-Offload, ZeRO-Infinity, FSDP ``cpu_offload``): those states in host memory (`Prediction.host`);
  to an NVMe drive (ZeRO-Infinity's ``nvme``): on the drive (`Prediction.drive`) what DeepSpeed swaps, a tensor
  part of at least 1 MiB per rank (the flat fp32 partition with its optimizer state, large parameters' gradients
  and, with parameter offload, partitions); the rest in host memory (measured equal to the files written,
  tests/multiproc/test_zero_infinity.py).
- tensor × pipeline × data: tensor-parallel rank 0's local parameters (from the census, split by the real plan),
  the blocks of the worst pipeline stage, and the data dimension (ddp's flat gradient average, or fsdp) over
  them.

Activations: the census' saved tensors at the rank's micro-batch (the step's global batch over the data ranks and
the accumulation steps; `polytrain.plan.command` holds the global batch fixed across layouts), only the block
inputs (plus what lies outside the blocks) with activation checkpointing, and for a pipeline stage its
micro-batches in flight (1F1B: ``min(M, P - s)``, GPipe: ``M``) plus the inputs and targets of the step's other
micro-batches, which the schedule holds. Model states plus activations plus the temporary buffers are summed: a
bound on the peak, not a trace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from polytrain.plan.activations import NATIVE_BACKENDS, activations, in_flight, stage_blocks, stage_params
from polytrain.plan.census import Census, Param

#: bytes per element of optimizer state beyond the parameter: Adam's two moments, SGD's momentum buffer
DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (elements)
DEFAULT_REUSE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance (elements)
SWAP_MIN = 2**20  # bytes: the smallest tensor part DeepSpeed writes to the drive (at the default aio.block_size)


@dataclass(frozen=True)
class Layout:
    """One way to run the spec: the backend and its options, the grid, activation checkpointing."""

    backend: str  # ddp | fsdp | deepspeed | local, or a TensorFlow data-parallel backend
    sharding: str | None = None  # fsdp
    stage: int | None = None  # deepspeed
    # "" | "optimizer" | "optimizer+params" (deepspeed, host memory) | "nvme-optimizer" | "nvme-optimizer+params"
    # (deepspeed, a drive: ZeRO-Infinity) | "cpu" (fsdp)
    offload: str = ""
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    checkpointing: bool = False
    nvme_path: str | None = None  # the drive's directory (nvme offloads)

    @property
    def on_drive(self) -> bool:
        return self.offload.startswith("nvme")

    @property
    def name(self) -> str:
        base = {"fsdp": f"fsdp {self.sharding}", "deepspeed": f"zero{self.stage}"}.get(self.backend, self.backend)
        if self.offload:
            base += f" +offload({self.offload})"
        if self.tensor > 1 or self.pipeline > 1:
            base += f" T{self.tensor}×P{self.pipeline}×D{self.data}"
        return base + (" +ac" if self.checkpointing else "")

    @property
    def shards_params(self) -> bool:
        return (self.backend == "fsdp" and self.sharding in ("full_shard", "hybrid_shard")) or (self.stage or 0) >= 3


@dataclass(frozen=True)
class Precision:
    """Bytes per element: parameters as the backend holds them, its gradients, the optimizer state per parameter."""

    name: str  # fp32 | bf16 | fp16
    optimizer_state: int  # 8 Adam, 4 SGD with momentum, 0 plain SGD

    @property
    def low(self) -> int:
        return 4 if self.name == "fp32" else 2


#: ZeRO under bf16/fp16: the fp32 gradient partition DeepSpeed makes from the low-precision gradients to step
FP32_GRADS = "fp32 gradient partition (optimizer step)"


def optimizer_state_bytes(name: str, momentum: float) -> int:
    """fp32 optimizer state bytes per parameter element: Adam/AdamW 8 (two moments), SGD 4 with momentum, else 0."""
    if name in ("adam", "adamw"):
        return 8
    return 4 if momentum > 0 else 0


@dataclass
class Prediction:
    """One layout's per-rank prediction (bytes; the worst rank)."""

    layout: Layout
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    master: float = 0.0
    activations: float = 0.0
    temporary: dict[str, float] = field(default_factory=dict)
    host: float = 0.0  # offloaded states, in host memory
    drive: float = 0.0  # offloaded states, in files on a drive (ZeRO-Infinity)
    micro_batch: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # collective kind → payload bytes per optimizer step
    wire: float = 0.0  # bytes this rank sends per step (link model)
    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def step_seconds(self) -> float:
        """Compute and communication of one step, added (no overlap assumed)."""
        return self.compute_seconds + self.comm_seconds

    @property
    def device(self) -> float:
        return self.model_states + self.activations + sum(self.temporary.values())

    def largest_part(self) -> tuple[str, float]:
        parts = {"parameters": self.params, "gradients": self.grads, "optimizer state": self.optimizer,
                 "master copies": self.master, "activations": self.activations, **self.temporary}
        return max(parts.items(), key=lambda kv: kv[1])


# ---------------------------------------------------------------- partitions
def fsdp_shard(params: Sequence[Param], group: int) -> int:
    """Elements of one rank's FSDP2 shard: each parameter's first dimension padded to a multiple of ``group``."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.shape else 1
        total += math.ceil(rows / group) * (p.numel // rows if rows else 0)
    return total


def zero_partition(params: Sequence[Param], group: int, align: int = 2) -> int:
    """ZeRO-1/2's partition length: the flat vector padded to a multiple of ``group × align``, cut in ``group``."""
    total = sum(p.numel for p in params)
    padded = math.ceil(total / (group * align)) * group * align
    return padded // group


def zero_straddling_grads(params: Sequence[Param], group: int, align: int = 2, rank: int | None = None) -> int:
    """Elements of the fp32 gradients a ZeRO-1/2 rank holds: every parameter reaching into its partition, whole
    (``rank``'s, or the worst rank's)."""
    length = zero_partition(params, group, align)
    worst, start = 0, 0
    spans = []
    for p in params:
        spans.append((start, start + p.numel))
        start += p.numel
    padding = length * group - start  # the flat vector's padding, at the end of the last partition
    for which in range(group) if rank is None else (rank,):
        lo, hi = which * length, (which + 1) * length
        held = sum(b - a for a, b in spans if a < hi and b > lo) + (padding if which == group - 1 else 0)
        worst = max(worst, held)
    return worst


def zero3_partition(params: Sequence[Param], group: int) -> int:
    """Elements of one rank's ZeRO-3 partition: each parameter cut on its own, padded."""
    return sum(math.ceil(p.numel / group) for p in params)


def largest_module(params: Sequence[Param]) -> int:
    """Elements of the largest module's own parameters (parameters grouped by their module's name)."""
    sizes: dict[str, int] = {}
    for p in params:
        owner = p.name.rpartition(".")[0]
        sizes[owner] = sizes.get(owner, 0) + p.numel
    return max(sizes.values(), default=0)


def fsdp_groups(layout: Layout, per_node: int | None) -> tuple[int, int]:
    """(shard, replicate) group sizes of fsdp's data dimension: hybrid_shard shards over the data ranks of one node
    (``per_node`` ranks per node) and replicates across nodes; the other strategies shard over all data ranks."""
    d = layout.data
    if layout.sharding != "hybrid_shard" or per_node is None or d * layout.tensor <= per_node:
        return d, 1
    shard = max(per_node // layout.tensor, 1)
    return shard, max(d // shard, 1)


def units(params: Sequence[Param]) -> list[list[Param]]:
    """FSDP's units: one per block, and the root (every parameter outside the blocks)."""
    grouped: dict[int | None, list[Param]] = {}
    for p in params:
        grouped.setdefault(p.block, []).append(p)
    return [grouped[k] for k in sorted(grouped, key=lambda k: -1 if k is None else k)]


# ---------------------------------------------------------------- model states
def model_states(layout: Layout, params: Sequence[Param], precision: Precision, group: int,
                 options: Mapping[str, Any] | None = None) -> Prediction:
    """Parameters, gradients, optimizer state and master copies of one rank holding ``params`` in ``layout``,
    sharded (where the layout shards) over ``group`` data ranks; temporary buffers included. ``options``: the
    backend settings (`polytrain.plan.candidates.backend_options`), ``per_node``, and ``data_rank`` (the rank
    within the data group; default: the worst one)."""
    options = options or {}
    out = Prediction(layout)
    n = sum(p.numel for p in params)
    s = precision.optimizer_state
    if layout.backend == "fsdp":
        shard = fsdp_shard(params, fsdp_groups(layout, options.get("per_node"))[0])
        states = 4 * shard + 4 * shard + s * shard
        sizes = sorted((sum(p.numel for p in u) for u in units(params)), reverse=True)  # elements per unit
        largest = sizes[0] if sizes else 0
        compute = 4 if precision.name == "fp32" else 2
        # shard_grad_op keeps every unit gathered; the others, at most the two largest at once (prefetch)
        out.temporary["unsharded parameters"] = compute * (n if layout.sharding == "shard_grad_op" else sum(sizes[:2]))
        reduce = 4 if options.get("reduce_fp32", True) or precision.name == "fp32" else 2
        out.temporary["reduce-scatter input"] = reduce * largest
        if options.get("accum", 1) > 1:  # gradient sync off between micro-steps: each unit's gradient kept whole
            out.temporary["unsharded gradients (accumulation)"] = reduce * n
        if layout.offload:
            out.host = states
        else:
            out.params, out.grads, out.optimizer = 4 * shard, 4 * shard, s * shard
        return out
    if layout.backend == "deepspeed":
        return _zero(out, params, precision, group, options)
    # ddp, local, the tensor/pipeline data dimension, TensorFlow's replicas: the whole (local) model
    grads = sum(p.grad_elements for p in params)
    out.params, out.grads, out.optimizer = 4 * n, 4 * grads, s * n
    if layout.tensor > 1 or layout.pipeline > 1:
        if group > 1:
            out.temporary["flat gradient average"] = 4 * grads
    elif layout.backend == "ddp" and group > 1:
        out.temporary["ddp gradient buckets"] = 4 * n
    return out


def _zero(out: Prediction, params: Sequence[Param], precision: Precision, group: int,
          options: Mapping[str, Any]) -> Prediction:
    layout, s, low = out.layout, precision.optimizer_state, precision.low
    n = sum(p.numel for p in params)
    offload = layout.offload
    bucket = options.get("reduce_bucket_size", DEFAULT_BUCKET)
    if (layout.stage or 0) <= 2:
        part = zero_partition(params, group)
        out.params = low * part * group  # views into one flat, padded vector
        grads = low * zero_straddling_grads(params, group, rank=options.get("data_rank"))
        master = 4 * part if (precision.name != "fp32" or offload) else 0
        out.grads = 0 if offload else grads
        out.master, out.optimizer = (0, 0) if offload else (master, s * part)
        out.host = (4 * part + s * part + 4 * part) if offload else 0
        if precision.name != "fp32" and not offload:
            out.temporary[FP32_GRADS] = 4 * part
        out.temporary["reduce bucket"] = (4 if precision.name == "fp32" else low) * min(bucket, n)
        return out
    part = zero3_partition(params, group)
    threshold = options.get("persistence_threshold", DEFAULT_PERSISTENCE)
    persistent = sum(p.numel for p in params if p.numel < threshold) if group > 1 else 0
    largest = largest_module(params)
    params_bytes = low * part + low * persistent
    master = 4 * part if (precision.name != "fp32" or offload) else 0
    if layout.on_drive:
        _zero_infinity(out, params, precision, group, params_bytes, options)
    elif "params" in offload:
        out.host = low * part + 4 * part + 4 * part + s * part
    elif offload:
        out.params = params_bytes
        out.host = master + 4 * part + s * part
    else:
        out.params, out.grads, out.master, out.optimizer = params_bytes, low * part, master, s * part
        if precision.name != "fp32":
            out.temporary[FP32_GRADS] = 4 * part
    out.temporary["gathered module (parameters + gradients)"] = 2 * low * largest
    kept = sum(p.numel for p in zero3_kept(params, options))
    if kept > largest:
        out.temporary["parameters kept gathered for reuse"] = low * (kept - largest)
    return out


def _zero_infinity(out: Prediction, params: Sequence[Param], precision: Precision, group: int,
                   params_bytes: float, options: Mapping[str, Any]) -> None:
    """ZeRO-3 with the optimizer (and the parameters) offloaded to a drive. DeepSpeed writes a tensor there only when
    a rank's part of it is at least `SWAP_MIN`: the flat fp32 partition with its optimizer state (one sub-group
    here) and, while it steps, the gradients of each large parameter; with parameter offload each large parameter's
    partition too (a copy: DeepSpeed keeps up to ``max_in_cpu`` elements of the partition in host memory as well,
    1e9 by default). In host memory: the rest, the optimizer swapper's pinned buffers (``buffer_count`` of the
    partition's size) and the parameter swapper's (``buffer_count`` × ``buffer_size`` elements, 2 GB in fp32 at
    DeepSpeed's defaults)."""
    s, low = precision.optimizer_state, precision.low
    part, big, moved = swapped_parts(params, group, low)
    if 4 * part >= SWAP_MIN:
        out.drive = (4 + s) * part + 4 * big
        out.host = 4 * (part - big) + 4 * options.get("optimizer_buffers", 4) * part
    else:
        out.host = 4 * part + (4 + s) * part
    if "params" in out.layout.offload:
        out.drive += low * moved
        held = min(part, part - moved + options.get("max_in_cpu", 10**9))  # DeepSpeed keeps up to max_in_cpu
        out.host += low * held + low * options.get("param_buffers", 5 * 10**8)
    else:
        out.params = params_bytes


def swapped_parts(params: Sequence[Param], group: int, low: int) -> tuple[int, int, int]:
    """ZeRO-Infinity's rule, in elements of one rank: its flat ZeRO-3 partition, the parts of the parameters large
    enough (`SWAP_MIN`) for their fp32 gradients to be swapped, and of those whose partitions in the training dtype
    (``low`` bytes) are."""
    parts = [math.ceil(p.numel / group) for p in params]
    return (zero3_partition(params, group), sum(n for n in parts if 4 * n >= SWAP_MIN),
            sum(n for n in parts if low * n >= SWAP_MIN))


def zero3_kept(params: Sequence[Param], options: Mapping[str, Any]) -> list[Param]:
    """The partitioned ZeRO-3 parameters that stay gathered from their forward to their backward: those whose next
    use lies within ``stage3_max_reuse_distance`` elements of other parameters fetched in between (the later
    ones, forward and backward)."""
    threshold = options.get("persistence_threshold", DEFAULT_PERSISTENCE)
    reuse = options.get("max_reuse_distance", DEFAULT_REUSE)
    moving = [p for p in params if p.numel >= threshold]
    kept, later = [], 0
    for p in reversed(moving):
        if 2 * later <= reuse:
            kept.append(p)
        later += p.numel
    return kept


def zero_paper_bytes(stage: int, group: int, state: int = 8, weights: int = 4) -> float:
    """Bytes per parameter in the ZeRO paper's accounting: ``weights`` bytes each of parameters and gradients and
    ``state`` of optimizer state, stage 1 sharding the optimizer state over ``group`` ranks, 2 the gradients too, 3
    the parameters too (0: DDP; FSDP full_shard is stage 3). `predict_memory` refines it per backend (padding,
    DeepSpeed's gradient views, buckets); bench/sharded_memory.py prints both against measurement."""
    shards = {0: (1, 1, 1), 1: (1, 1, group), 2: (1, group, group), 3: (group, group, group)}[stage]
    return weights / shards[0] + weights / shards[1] + state / shards[2]


def predict_memory(census: Census, layout: Layout, precision: Precision, *, batch: float,
                   options: Mapping[str, Any] | None = None, microbatches: int | None = None,
                   schedule: str = "1f1b", stage: int | None = None) -> Prediction:
    """The worst rank's memory in ``layout`` (see the module's docstring), or that of pipeline ``stage``'s ranks;
    ``batch``: samples per data rank per micro-step."""
    options = dict(options or {})
    if layout.pipeline == 1:
        params = census.local_params[layout.tensor]
        pred = model_states(layout, params, precision, layout.data, options)
        pred.activations, recompute = activations(census, layout.tensor, layout.checkpointing, batch,
                                                   native=layout.backend in NATIVE_BACKENDS)
        if recompute:
            pred.temporary["block recompute"] = recompute
        pred.micro_batch = batch
        return pred
    m = microbatches or layout.pipeline
    worst: Prediction | None = None
    ranges = stage_blocks(census, layout.pipeline)
    for s, blocks in enumerate(ranges):
        if stage is not None and s != stage:
            continue
        first, last = s == 0, s == len(ranges) - 1
        params = stage_params(census, layout.tensor, blocks, first, last)
        pred = model_states(layout, params, precision, layout.data, options)
        acts, recompute = activations(census, layout.tensor, layout.checkpointing, batch / m, blocks, first,
                                       last, native=layout.backend in NATIVE_BACKENDS)
        held = in_flight(schedule, m, layout.pipeline, s)
        # the step's other micro-batches: their inputs (received, or the batch's split) and targets stay held
        waiting = census.sample_bytes[0] * batch / m if first else \
            census.traces[layout.tensor].block_outputs[blocks[0] - 1].at(batch / m)
        waiting += census.sample_bytes[1] * batch / m if last else 0.0
        pred.activations = acts * held + (m - held) * waiting
        if recompute:
            pred.temporary["block recompute"] = recompute
        pred.temporary["pipeline send/recv"] = 2 * census.traces[layout.tensor].block_outputs[blocks[-1]].at(batch / m)
        pred.micro_batch = batch / m
        if worst is None or pred.device > worst.device:
            worst = pred
    assert worst is not None
    return replace(worst, layout=layout)

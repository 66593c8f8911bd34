"""Per-step communication of a layout: the bytes of each collective kind one rank takes part in per optimizer step,
what it sends over the wire, and the time that takes on a link model. Pure arithmetic over a census.

Payload is a collective's full tensor — an all-reduce's buffer, an all-gather's output, a reduce-scatter's input,
a point-to-point message — summed over the step (``loop.grad_accum_steps`` micro-steps, a pipeline's micro-batches).
What a rank sends over the wire in a ring of ``n`` ranks is `wire_factor` times that: ``2(n-1)/n`` for an
all-reduce, ``(n-1)/n`` for an all-gather, a reduce-scatter or a broadcast, the whole message for point-to-point.

Per layout (as polytrain runs it; S the shard group, D the data ranks, k micro-steps per step):

- ``ddp``: one all-reduce of every fp32 gradient per step (its buckets), a broadcast of the buffers per micro-step.
- ``fsdp``: per micro-step an all-gather of each unit's padded shards in the compute dtype — twice where units are
  resharded after their forward (``full_shard``, ``hybrid_shard``: polytrain sets ``reshard_after_forward`` on
  every unit, the root too) — and per step a reduce-scatter of the gradients (fp32 unless ``fsdp.reduce_fp32`` is
  off); ``hybrid_shard`` also all-reduces the gradient shards across nodes.
- ZeRO-1/2: the gradients all-reduced in buckets (DeepSpeed's ``use_multi_rank_bucket_allreduce``, on by default),
  each rank keeping its partition — ZeRO-1 once per step, ZeRO-2 every micro-step (it keeps no whole gradients
  to accumulate in) — and the updated partitions all-gathered once per step.
- ZeRO-3: each partitioned parameter all-gathered for the forward of every micro-step and again for its backward
  unless DeepSpeed keeps it gathered (``stage3_max_reuse_distance``), the persistent ones (below
  ``stage3_param_persistence_threshold``) once per step after their update, the gradients reduce-scattered every
  micro-step.
- tensor parallel: the DTensor collectives the census counted in one traced forward and backward, per micro-step
  (a pipeline stage: those counted for its blocks, and for what comes before the first block or after the last
  where it holds that).
- pipeline: each micro-batch's activation at the stage boundary forward and its gradient back (the busiest stage).
- the data dimension of a tensor/pipeline layout: one flat all-reduce of the local gradients (ddp), or fsdp's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import SpecError
from polytrain.plan.activations import stage_blocks, stage_params
from polytrain.plan.census import Census, Param
from polytrain.plan.memory import (
    DEFAULT_PERSISTENCE,
    SWAP_MIN,
    Layout,
    Precision,
    fsdp_groups,
    fsdp_shard,
    swapped_parts,
    units,
    zero3_kept,
    zero_partition,
)

KINDS = ("allreduce", "allgather", "reducescatter", "broadcast", "p2p", "host", "drive")
LOCAL = ("p2p", "host", "drive")  # one transfer, no ring
GB = 1e9


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank sends per payload byte in a ring of ``n`` ranks (see the module's docstring)."""
    if kind in LOCAL:
        return 1.0
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "allreduce" else (n - 1) / n


@dataclass(frozen=True)
class Link:
    """Bandwidths in bytes per second: within a node, between nodes, device ↔ host (offload), host ↔ drive (nvme
    offload, reads and writes together)."""

    intra: float = 100 * GB
    inter: float = 12.5 * GB
    host: float = 25 * GB
    drive: float = 3 * GB


def parse_link(text: str) -> Link:
    """``intra=GB/s,inter=GB/s[,host=GB/s][,drive=GB/s]`` → a `Link`; a one-line error naming ``--link`` otherwise."""
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("intra", "inter", "host", "drive"):
            raise SpecError(f"--link: expected intra=GB/s,inter=GB/s[,host=GB/s][,drive=GB/s], got {part!r}")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise SpecError(f"--link: {key} must be a positive number of GB/s, got {value!r}")
        values[key] = number * GB
    return Link(**{**Link().__dict__, **values})


@dataclass
class Traffic:
    """One rank's collectives of a step: (kind, payload bytes, group size, crosses nodes) entries."""

    entries: list[tuple[str, float, int, bool]]

    def add(self, kind: str, payload: float, group: int, inter: bool) -> None:
        if payload > 0 and (group > 1 or kind in LOCAL):
            self.entries.append((kind, payload, group, inter))

    def payload(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, payload, _, _ in self.entries:
            out[kind] = out.get(kind, 0.0) + payload
        return out

    def wire(self) -> float:
        return sum(payload * wire_factor(kind, n) for kind, payload, n, _ in self.entries if kind not in LOCAL[1:])

    def seconds(self, link: Link) -> float:
        total = 0.0
        for kind, payload, n, inter in self.entries:
            speed = {"host": link.host, "drive": link.drive}.get(kind, link.inter if inter else link.intra)
            total += payload * wire_factor(kind, n) / speed
        return total


def _fsdp(traffic: Traffic, params: Sequence[Param], precision: Precision, layout: Layout, shard: int,
          replicate: int, accum: int, options: Mapping[str, Any], inter: tuple[bool, bool]) -> None:
    compute = 4 if precision.name == "fp32" else 2
    reduce = 4 if options.get("reduce_fp32", True) or precision.name == "fp32" else 2
    groups = units(params)
    reshard = layout.sharding in ("full_shard", "hybrid_shard")
    gathered = sum(shard * fsdp_shard(unit, shard) * (2 if reshard else 1) for unit in groups)
    traffic.add("allgather", accum * compute * gathered, shard, inter[0])
    traffic.add("reducescatter", reduce * shard * fsdp_shard(params, shard), shard, inter[0])
    if replicate > 1:
        traffic.add("allreduce", reduce * fsdp_shard(params, shard), replicate, inter[1])
    if layout.offload:
        traffic.add("host", 4 * fsdp_shard(params, shard) * (accum + 1), 1, False)


def _zero(traffic: Traffic, params: Sequence[Param], precision: Precision, layout: Layout, group: int, accum: int,
          options: Mapping[str, Any], inter: bool) -> None:
    low = precision.low
    n = sum(p.numel for p in params)
    if (layout.stage or 0) <= 2:  # DeepSpeed's default use_multi_rank_bucket_allreduce: buckets all-reduced
        # ZeRO-1 accumulates whole gradients and reduces them once; ZeRO-2 keeps only its partition, so reduces
        # every micro-step's
        traffic.add("allreduce", (accum if layout.stage == 2 else 1) * low * n, group, inter)
        traffic.add("allgather", low * group * zero_partition(params, group), group, inter)
        if layout.offload:
            traffic.add("host", (4 + low) * zero_partition(params, group), 1, False)
        return
    threshold = options.get("persistence_threshold", DEFAULT_PERSISTENCE)
    kept = {p.name for p in zero3_kept(params, options)}

    def gathered(chosen: Sequence[Param]) -> float:
        return low * group * sum(math.ceil(p.numel / group) for p in chosen)

    moving = [p for p in params if p.numel >= threshold]
    twice = [p for p in moving if p.name not in kept]
    # persistent parameters once per step (their updated partitions), the others per micro-step
    traffic.add("allgather", gathered([p for p in params if p.numel < threshold]) + accum * (
        gathered(moving) + gathered(twice)), group, inter)
    traffic.add("reducescatter", accum * low * group * sum(math.ceil(p.numel / group) for p in params), group,
                inter)
    if layout.offload:
        part = sum(math.ceil(p.numel / group) for p in params)
        fetched = 2 * accum * low * part if "params" in layout.offload else low * part
        traffic.add("host", 4 * part + fetched, 1, False)
    if layout.on_drive:
        traffic.add("drive", _drive_bytes(params, precision, layout, group, accum, options.get("max_in_cpu", 10**9)),
                    1, False)


def _drive_bytes(params: Sequence[Param], precision: Precision, layout: Layout, group: int, accum: int,
                 max_in_cpu: int) -> float:
    """Bytes read and written on the drive per step (ZeRO-Infinity): the fp32 partition and its optimizer state in
    and out, the swapped gradients out and in, with parameter offload each swapped parameter read for the forward
    and the backward of every micro-step and written once, beyond the ``max_in_cpu`` elements DeepSpeed keeps in
    host memory; what `memory._zero_infinity` puts there."""
    part, big, moved = swapped_parts(params, group, precision.low)
    if 4 * part < SWAP_MIN:
        return 0.0
    total = 2 * (4 + precision.optimizer_state) * part + 2 * 4 * big
    if "params" in layout.offload:  # what max_in_cpu does not keep in host memory: read twice a micro-step
        total += (2 * accum + 1) * precision.low * max(0, moved - max_in_cpu)
    return total


def predict_comms(census: Census, layout: Layout, precision: Precision, *, batch: float, accum: int,
                  nodes: int, world: int, options: Mapping[str, Any] | None = None,
                  microbatches: int | None = None, stage: int | None = None) -> Traffic:
    """The busiest rank's collectives per optimizer step in ``layout`` (see the module's docstring), or those of
    pipeline ``stage``'s ranks; ``batch``: samples per data rank per micro-step."""
    options = dict(options or {})
    per_node = max(world // max(nodes, 1), 1)
    t, p, d = layout.tensor, layout.pipeline, layout.data
    data_inter, tensor_inter = d * t > per_node, t > per_node
    best: Traffic | None = None
    ranges = stage_blocks(census, p) if p > 1 else [range(census.n_blocks)]
    m = (microbatches or p) if p > 1 else 1
    for s, blocks in enumerate(ranges):
        if stage is not None and s != stage:
            continue
        first, last = s == 0, s == len(ranges) - 1
        params = stage_params(census, t, blocks, first, last) if p > 1 else list(census.local_params[t])
        traffic = Traffic([])
        if layout.backend == "fsdp":
            shard, replicate = fsdp_groups(layout, per_node)
            _fsdp(traffic, params, precision, layout, shard, replicate, accum, options,
                  (shard * t > per_node, True))
        elif layout.backend == "deepspeed":
            _zero(traffic, params, precision, layout, d, accum, options, data_inter)
        else:
            traffic.add("allreduce", 4 * sum(q.grad_elements for q in params), d, data_inter)
            if p == 1 and t == 1:
                traffic.add("broadcast", accum * census.buffer_bytes, d, data_inter)
        if t > 1:  # the collectives of the stage's own part of the model (all of it without a pipeline)
            trace = census.traces[t]
            for kind in trace.collectives:
                sent = trace.collective_bytes(kind, batch / m, blocks, first, last)
                traffic.add(kind, accum * m * sent, t, tensor_inter)
        if p > 1:
            boundary = census.traces[t].block_outputs
            sent = (0.0 if last else boundary[blocks[-1]].at(batch / m)) + \
                (0.0 if first else boundary[blocks[0] - 1].at(batch / m))
            traffic.add("p2p", accum * m * sent, 2, d * t * p > per_node)
            if (first or last) and census.tied:  # the two copies of a tied weight: their gradients summed
                traffic.add("allreduce", 4 * sum(q.grad_elements for q in params if q.name in census.tied), 2,
                            d * t * p > per_node)
        if best is None or traffic.wire() > best.wire():
            best = traffic
    assert best is not None
    return best


def compute_seconds(census: Census, layout: Layout, *, batch: float, accum: int, microbatches: int | None,
                    tflops: float) -> float:
    """Compute time of one optimizer step on the busiest rank at ``tflops`` TFLOP/s: the census' forward FLOPs at
    the micro-batch, three times over (forward, and a backward of twice its work), four with checkpointing (the
    blocks' forward again), split over the tensor ranks, and for a pipeline one stage's share of each of its
    ``M + P - 1`` schedule slots (the bubble)."""
    forward = census.traces[1].flops
    passes = 4 if layout.checkpointing else 3
    if layout.pipeline == 1:
        return accum * passes * forward.at(batch) / layout.tensor / (tflops * 1e12)
    m = microbatches or layout.pipeline
    slot = passes * forward.at(batch / m) / layout.pipeline / layout.tensor
    return accum * (m + layout.pipeline - 1) * slot / (tflops * 1e12)

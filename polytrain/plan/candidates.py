"""The layouts `polytrain plan` weighs for a spec on N ranks, the ``--set`` overrides that run each one, and how
they are ranked.

Validity is `polytrain.spec.layout`'s (the same rules a run checks: ``check_spec``, ``check_model``, ``grid_for``,
``check_blocks``); a grid the model or world does not allow is not a candidate. PyTorch specs get ddp (``local``
on one rank), fsdp full_shard / shard_grad_op (and hybrid_shard on several nodes, cpu_offload with full_shard),
ZeRO-1/2/3 with and without optimizer offload (and ZeRO-3 with parameter offload; given a drive's directory, ZeRO-3
offloaded to it, ZeRO-Infinity), every tensor × pipeline × data
grid over ddp or fsdp, each with activation checkpointing off and on where the model declares blocks.
TensorFlow specs get their data-parallel backends.

The recommendation is the simplest layout that fits (`TIERS`: replicated, then sharded optimizer state and
gradients, then sharded parameters, then tensor/pipeline parallel, then offload to host memory, then to a drive;
checkpointing off before on),
the shortest estimated step among equals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from polytrain.errors import SpecError
from polytrain.plan.census import Census
from polytrain.plan.memory import DEFAULT_BUCKET, DEFAULT_PERSISTENCE, DEFAULT_REUSE, Layout, Prediction
from polytrain.spec.tables import TrainSpec

TF_BACKENDS = ("mpi", "horovod", "tf-multiworker")


def tier(layout: Layout) -> int:
    """How much machinery a layout adds (lower is simpler): see the module's docstring."""
    if layout.on_drive:
        return 5
    if layout.offload:
        return 4
    if layout.tensor > 1 or layout.pipeline > 1:
        return 3
    if layout.shards_params:
        return 2
    if layout.backend == "deepspeed" or (layout.backend == "fsdp" and layout.sharding == "shard_grad_op"):
        return 1
    return 0


def backend_options(spec: TrainSpec) -> dict[str, Any]:
    """The backend settings the formulas read from the spec (DeepSpeed config keys, fsdp.reduce_fp32)."""
    zero = spec.deepspeed.config.get("zero_optimization", {})
    zero = zero if isinstance(zero, Mapping) else {}
    swapped = {key: zero.get(key) if isinstance(zero.get(key), Mapping) else {}
               for key in ("offload_optimizer", "offload_param")}
    return {"optimizer_buffers": int(swapped["offload_optimizer"].get("buffer_count", 4)),
            "param_buffers": int(swapped["offload_param"].get("buffer_count", 5))
            * int(swapped["offload_param"].get("buffer_size", 10**8)),
            "max_in_cpu": int(swapped["offload_param"].get("max_in_cpu", 10**9)),
            "persistence_threshold": int(zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE)),
            "reduce_bucket_size": int(zero.get("reduce_bucket_size", DEFAULT_BUCKET)),
            "max_reuse_distance": int(zero.get("stage3_max_reuse_distance", DEFAULT_REUSE)),
            "reduce_fp32": spec.fsdp.reduce_fp32}


def _grid_allowed(spec: TrainSpec, census: Census, world: int, t: int, p: int, data_backend: str,
                  samples: int) -> bool:
    from polytrain import registry
    from polytrain.spec.layout import ParallelSpec, check_blocks, check_model, check_spec, grid_for

    parallel = ParallelSpec(tensor=t, pipeline=p, tensor_plan=spec.parallel.tensor_plan if t > 1 else None,
                            microbatches=spec.parallel.microbatches if p > 1 else None,
                            schedule=spec.parallel.schedule if p > 1 else "1f1b")
    try:
        per_rank, left = divmod(samples, world // (t * p) * spec.loop.grad_accum_steps)
        if left:
            return False
        check_spec(parallel, framework=spec.framework, backend=data_backend,
                   data_backends=registry.layout_backends(spec.framework), batch_size=per_rank)
        check_model(parallel, spec.model.name, spec.model.params)
        grid_for(parallel, world, 0)
        if p > 1:
            check_blocks(parallel, census.n_blocks, "the model's blocks")
    except SpecError:
        return False
    if t > 1 and t not in census.tensor_degrees:
        return False
    return not (p > 1 and not census.embed)


def candidates(spec: TrainSpec, census: Census, world: int, nodes: int, samples: int,
               nvme_path: str | None = None) -> list[Layout]:
    """Every layout the spec's model, ``world`` ranks and ``nodes`` nodes allow (see the module's docstring), each
    training on ``samples`` per step; with ``nvme_path`` (or the spec's), ZeRO-3 offloaded to that drive too."""
    nvme_path = nvme_path or spec.deepspeed.nvme_path
    if spec.framework == "tensorflow":
        names = ("local",) if world == 1 else TF_BACKENDS
        return [Layout(name, data=world) for name in names]
    checkpointing = (False, True) if census.n_blocks else (False,)
    out: list[Layout] = []
    for ac in checkpointing:
        if world == 1:
            out.append(Layout("local", data=1, checkpointing=ac))
        else:
            out.append(Layout("ddp", data=world, checkpointing=ac))
            shardings = ["full_shard", "shard_grad_op"] + (["hybrid_shard"] if nodes > 1 else [])
            out += [Layout("fsdp", sharding=s, data=world, checkpointing=ac) for s in shardings]
            out.append(Layout("fsdp", sharding="full_shard", offload="cpu", data=world, checkpointing=ac))
        for stage in (1, 2, 3):
            if world > 1:
                out.append(Layout("deepspeed", stage=stage, data=world, checkpointing=ac))
            out.append(Layout("deepspeed", stage=stage, offload="optimizer", data=world, checkpointing=ac))
        out.append(Layout("deepspeed", stage=3, offload="optimizer+params", data=world, checkpointing=ac))
        if nvme_path and spec.framework == "torch":
            out += [Layout("deepspeed", stage=3, offload=f"nvme-{what}", data=world, checkpointing=ac,
                           nvme_path=nvme_path) for what in ("optimizer", "optimizer+params")]
        for t in range(1, world + 1):
            for p in range(1, world // t + 1):
                if (t, p) == (1, 1) or world % (t * p):
                    continue
                d = world // (t * p)
                for data_backend in ("ddp", "fsdp") if d > 1 else ("ddp",):
                    if _grid_allowed(spec, census, world, t, p, data_backend, samples):
                        out.append(Layout(data_backend, sharding="full_shard" if data_backend == "fsdp" else None,
                                          tensor=t, pipeline=p, data=d, checkpointing=ac))
    return out


def spec_layout(spec: TrainSpec, world: int) -> Layout:
    """The layout ``spec`` itself runs at ``world`` ranks."""
    backend = spec.backend if spec.backend != "auto" else ("ddp" if world > 1 else "local")
    t, p = spec.parallel.tensor, spec.parallel.pipeline
    offload = ""
    if backend == "fsdp" and spec.fsdp.cpu_offload:
        offload = "cpu"
    ds = spec.deepspeed
    if backend == "deepspeed" and ds.offload_optimizer:
        offload = "optimizer+params" if ds.offload_param else "optimizer"
        offload = f"nvme-{offload}" if ds.uses_nvme else offload
    return Layout(backend, sharding=spec.fsdp.sharding if backend == "fsdp" else None,
                  stage=ds.stage if backend == "deepspeed" else None, offload=offload, tensor=t,
                  pipeline=p, data=max(world // (t * p), 1),
                  checkpointing=spec.activation_checkpointing or spec.fsdp.activation_checkpointing,
                  nvme_path=ds.nvme_path if offload.startswith("nvme") else None)


def overrides(spec: TrainSpec, layout: Layout, samples: int | None = None) -> list[str]:
    """The ``--set KEY=VALUE`` overrides that turn ``spec`` into ``layout`` (only what differs): the backend and its
    options, the grid, checkpointing, and the other backends' option tables and the pipeline- or tensor-only
    ``parallel`` fields put back to their defaults where the layout does not use them (a spec refuses them then).
    ``samples``: the global batch to keep; a layout with fewer data ranks than the spec's own then gets
    ``data.global_batch_size`` (``data.batch_size`` is per data rank)."""
    from polytrain import registry
    from polytrain.spec import schema as schema
    from polytrain.spec.backend_options import AioSpec
    from polytrain.spec.layout import ParallelSpec

    wanted: dict[str, Any] = {"backend": layout.backend}
    if spec.framework == "torch":
        wanted["activation_checkpointing"] = layout.checkpointing
        wanted["parallel.tensor"], wanted["parallel.pipeline"] = layout.tensor, layout.pipeline
        defaults = schema.plain(ParallelSpec())
        wanted["parallel.data"] = "auto"
        unused = (("tensor_plan",) if layout.tensor == 1 else ()) + \
            (("microbatches", "schedule", "stages_per_rank", "stage_boundaries") if layout.pipeline == 1 else ())
        wanted.update({f"parallel.{name}": defaults[name] for name in unused})
    for table, options in registry.option_tables().items():
        if table != layout.backend:
            wanted.update({f"{table}.{k}": v for k, v in schema.plain(options()).items()})
    if layout.backend == "fsdp":
        wanted["fsdp.sharding"], wanted["fsdp.cpu_offload"] = layout.sharding, layout.offload == "cpu"
        wanted["fsdp.activation_checkpointing"] = False
    if layout.backend == "deepspeed":
        wanted["deepspeed.stage"] = layout.stage
        device = "nvme" if layout.on_drive else True
        wanted["deepspeed.offload_optimizer"] = device if layout.offload else False
        wanted["deepspeed.offload_param"] = device if "params" in layout.offload else False
        wanted["deepspeed.nvme_path"] = layout.nvme_path
        if not layout.on_drive:
            wanted.update({f"deepspeed.aio.{k}": v for k, v in schema.plain(AioSpec()).items()})
    world = layout.data * layout.tensor * layout.pipeline
    if samples is not None and spec.data.global_batch_size is None and layout.data != world:
        wanted["data.global_batch_size"] = samples
    current = spec.to_dict()
    out = []
    for key, value in wanted.items():
        node: Any = current
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node != value and not (isinstance(value, list) and node == tuple(value)):
            out.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    return out


def fits(pred: Prediction, limit: float, host: float | None = None, per_node: int = 1) -> bool:
    """Whether a layout fits a device of ``limit`` bytes and, given ``host``, a node whose ``per_node`` ranks keep
    their offloaded states in ``host`` bytes of memory."""
    return pred.device <= limit and (host is None or pred.host * per_node <= host)


def rank(predictions: list[Prediction], limit: float, host: float | None = None,
         per_node: int = 1) -> list[Prediction]:
    """Fitting layouts first (simplest, then the shortest estimated step, then least memory), then the rest by
    memory."""
    ok = [p for p in predictions if fits(p, limit, host, per_node)]
    rest = [p for p in predictions if not fits(p, limit, host, per_node)]
    ok.sort(key=lambda p: (tier(p.layout), p.layout.checkpointing, round(p.step_seconds, 9), p.device))
    rest.sort(key=lambda p: p.device)
    return ok + rest


def why_not(pred: Prediction, limit: float, host: float | None = None, per_node: int = 1) -> str:
    """The reason a layout does not fit, in words (empty when it fits)."""
    if pred.device > limit:
        part, size = pred.largest_part()
        return f"needs {gib(pred.device)} > {gib(limit)} (largest: {part} {gib(size)})"
    if not fits(pred, limit, host, per_node):
        return f"its host memory: {per_node} rank(s) × {gib(pred.host)} offloaded > {gib(host or 0)} per node"
    return ""


def gib(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"

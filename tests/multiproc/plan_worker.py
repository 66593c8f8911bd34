"""Measures, on each rank of a torchrun job, what `polytrain plan` predicts: for several layouts in turn, one rank's
parameter, gradient, optimizer-state and master-copy bytes (the tensors it holds after the backward pass of a
step, before that step's optimizer update; shards included), its peak bytes saved for the backward pass
(saved-tensor hooks: the most held at once), and the bytes of every collective of one optimizer step, by kind,
counted at the process-group level (a dispatch mode over torch's ``c10d`` and functional-collective operators);
with gradient accumulation over every micro-step of the step, and under fsdp the unsharded gradients it keeps
between micro-steps (`fsdp_accumulated`).

Each layout runs through the Trainer's own parts (`registry.create_backend`, `create_framework`, ``fit``'s
micro-step and optimizer step): steps 1 and 2 warm up (optimizer state made, the pipeline's shapes learnt, DDP's
buckets rebuilt and their order broadcast), step 3 is measured. Used by tests/multiproc/test_plan_measure.py and
bench/plan_accuracy.py.

Usage (under torchrun; `job_command` builds it): python plan_worker.py OUT CASE[,CASE...]   (names in `CASES`; rank r
writes OUT.r.json)
"""

from __future__ import annotations

import gc
import json
import shlex
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # bench/ is a folder of the repository, not installed

from bench.sharded_memory import inner_optimizer, storages  # noqa: E402

MLP = {"model": {"name": "mlp", "params": {"hidden_sizes": [96, 80]}},
       "data": {"name": "synthetic", "batch_size": 8, "synthetic": {"features": 48, "classes": 6, "samples": 64}}}
LM = {"model": {"name": "transformer", "params": {"d_model": 64, "n_heads": 4, "n_layers": 2, "tie_weights": False}},
      "data": {"name": "tokens", "batch_size": 4, "tokens": {"vocab": 96, "seq_len": 16, "samples": 64}}}
ADAM = {"optimizer": {"name": "adam", "lr": 1e-3}}
SGD = {"optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}}
ZERO3_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}

#: name → (world size, the spec's fields): MLP cases at 2 ranks, transformer cases at 4
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "mlp-ddp": (2, {**MLP, **ADAM, "backend": "ddp"}),
    "mlp-fsdp": (2, {**MLP, **ADAM, "backend": "fsdp"}),
    "mlp-fsdp-grad-op": (2, {**MLP, **SGD, "backend": "fsdp", "fsdp": {"sharding": "shard_grad_op"}}),
    "mlp-zero1": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 1}}),
    "mlp-zero2": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 2}}),
    "mlp-zero3": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 3, "config": ZERO3_ALL}}),
    "lm-ddp": (4, {**LM, **ADAM, "backend": "ddp"}),
    "lm-ddp-ac": (4, {**LM, **ADAM, "backend": "ddp", "activation_checkpointing": True}),
    "lm-fsdp": (4, {**LM, **ADAM, "backend": "fsdp"}),
    "lm-t2": (4, {**LM, **ADAM, "backend": "ddp", "parallel": {"tensor": 2}}),
    "lm-p2": (4, {**LM, **ADAM, "backend": "ddp", "parallel": {"pipeline": 2}}),
    "lm-t2p2": (4, {**LM, **ADAM, "backend": "ddp", "parallel": {"tensor": 2, "pipeline": 2}}),
    # the tied head under pipeline parallel: the last stage holds a copy, both copies' gradients all-reduced
    "lm-p2-tied": (4, {**LM, "model": {"name": "transformer", "params": {**LM["model"]["params"], "tie_weights": True}},
                       **ADAM, "backend": "ddp", "parallel": {"pipeline": 2}}),
    "lm-zero3": (4, {**LM, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 3}}),
    # shards within each of the 4-rank job's two nodes, replicates (all-reduces the shards) across them
    "lm-fsdp-hybrid": (4, {**LM, **ADAM, "backend": "fsdp", "fsdp": {"sharding": "hybrid_shard"}}),
    "lm-ddp-bf16": (4, {**LM, **ADAM, "backend": "ddp", "precision": "bf16"}),
    "lm-zero3-bf16": (4, {**LM, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 3}, "precision": "bf16"}),
    "mlp-ddp-bf16": (2, {**MLP, **ADAM, "backend": "ddp", "precision": "bf16"}),
    "mlp-ddp-fp16": (2, {**MLP, **ADAM, "backend": "ddp", "precision": "fp16"}),
    "mlp-fsdp-bf16": (2, {**MLP, **ADAM, "backend": "fsdp", "precision": "bf16"}),
    "mlp-fsdp-fp16": (2, {**MLP, **ADAM, "backend": "fsdp", "precision": "fp16"}),
    "mlp-zero1-bf16": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 1}, "precision": "bf16"}),
    "mlp-zero2-bf16": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 2}, "precision": "bf16"}),
    "mlp-ddp-accum2": (2, {**MLP, **ADAM, "backend": "ddp", "loop": {"grad_accum_steps": 2}}),
    "mlp-fsdp-bf16-accum2": (2, {**MLP, **ADAM, "backend": "fsdp", "precision": "bf16",
                                 "loop": {"grad_accum_steps": 2}}),
    "mlp-zero2-accum2": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 2},
                             "loop": {"grad_accum_steps": 2}}),
    "mlp-zero1-accum2": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 1},
                             "loop": {"grad_accum_steps": 2}}),
    "mlp-zero3-accum2": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 3, "config": ZERO3_ALL},
                             "loop": {"grad_accum_steps": 2}}),
    "mlp-zero2-offload": (2, {**MLP, **ADAM, "backend": "deepspeed",
                              "deepspeed": {"stage": 2, "offload_optimizer": True}}),
    "mlp-zero3-offload": (2, {**MLP, **ADAM, "backend": "deepspeed",
                              "deepspeed": {"stage": 3, "offload_optimizer": True, "offload_param": True,
                                            "config": ZERO3_ALL}}),
    "mlp-fsdp-offload": (2, {**MLP, **ADAM, "backend": "fsdp", "fsdp": {"cpu_offload": True}}),
    "mlp-zero3-bf16": (2, {**MLP, **ADAM, "backend": "deepspeed", "deepspeed": {"stage": 3, "config": ZERO3_ALL},
                           "precision": "bf16"}),
}
#: world size → nodes: the 4-rank job runs as two torchrun agents of 2 ranks each on this host (two nodes to the
#: ranks: ``LOCAL_WORLD_SIZE`` 2), so that hybrid_shard has nodes to shard within
NODES = {2: 1, 4: 2}


def job_command(world: int, out: str, names: list[str], bin_dir: Path, port: int) -> list[str]:
    """The command that measures ``names`` on ``world`` ranks, writing ``OUT.<rank>.json``: torchrun, or on more
    than one node (`NODES`) one torchrun agent per node, all on this host, under one shell that fails if any does."""
    nodes = NODES[world]
    agents = [[str(bin_dir / "torchrun"), f"--nnodes={nodes}", f"--node_rank={r}",
               f"--nproc_per_node={world // nodes}", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(Path(__file__).resolve()), out, ",".join(names)] for r in range(nodes)]
    if nodes == 1:
        return agents[0]
    return ["bash", "-c", " & ".join(shlex.join(a) for a in agents)
            + " & status=0; for agent in $(jobs -p); do wait $agent || status=1; done; exit $status"]


KINDS = {"allreduce_": "allreduce", "allreduce_coalesced_": "allreduce", "all_reduce": "allreduce",
         "all_reduce_coalesced": "allreduce", "_allgather_base_": "allgather", "allgather_": "allgather",
         "allgather_into_tensor_coalesced_": "allgather", "all_gather_into_tensor": "allgather",
         "all_gather_into_tensor_coalesced": "allgather", "_reduce_scatter_base_": "reducescatter",
         "reduce_scatter_": "reducescatter", "reduce_scatter_tensor_coalesced_": "reducescatter",
         "reduce_scatter_tensor": "reducescatter", "reduce_scatter_tensor_coalesced": "reducescatter",
         "reduce_": "reducescatter", "broadcast_": "broadcast", "send": "p2p", "recv_": "p2p_received"}
CONTROL = 64  # bytes: a collective smaller than this carries a flag or a norm, counted apart as "control"
#: which argument holds the full tensor(s): an all-gather's output (0), a reduction's input (1 for the base ops)
FULL_ARG = {"_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1}


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def collective_counter() -> Any:
    """A dispatch mode adding up each collective's full-tensor bytes by kind (see the module's docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = {}
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            kind = KINDS.get(name) if func.namespace in ("c10d", "_c10d_functional") else None
            if kind is not None:
                if func.namespace == "_c10d_functional":
                    full = out if kind == "allgather" else args[0]
                else:
                    full = args[FULL_ARG.get(name, 0)]
                nbytes = _nbytes(full)
                if nbytes < CONTROL:  # a flag or a norm (DeepSpeed's overflow check): not the step's traffic
                    kind, name = "control", f"{name} (control)"
                self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
                self.calls[name] = self.calls.get(name, 0) + 1
            return out

    return Counter()


class SavedPeak:
    """The most bytes of distinct storages saved for the backward pass at once (parameters left out)."""

    def __init__(self, module: Any) -> None:
        self.module, self.live, self.peak = module, {}, 0

    def _params(self) -> set[int]:
        return {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in self.module.parameters()}

    def pack(self, t: Any) -> Any:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in self._params():
            size, count = self.live.get(key, (storage.nbytes(), 0))
            self.live[key] = (size, count + 1)
            weakref.finalize(t, self._drop, key)
            self.peak = max(self.peak, sum(n for n, _ in self.live.values()))
        return t

    def _drop(self, key: int) -> None:
        size, count = self.live.get(key, (0, 1))
        if count <= 1:
            self.live.pop(key, None)
        else:
            self.live[key] = (size, count - 1)


def model_states(module: Any, optimizer: Any) -> dict[str, int]:
    """Parameters (ZeRO-3's partitions too), gradients (ZeRO's reduced partitions too), optimizer state and
    master copies this rank holds, each storage counted once, in that order of precedence."""
    import torch

    params = list(module.parameters())
    params += [p.ds_tensor for p in module.parameters() if hasattr(p, "ds_tensor")]
    param_ptrs = storages(params)
    inner = inner_optimizer(optimizer)
    flat = [p for g in inner.param_groups for p in g["params"]]
    flat += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    master = [p for p in flat if getattr(p, "_local_tensor", p).untyped_storage().data_ptr() not in param_ptrs]
    held = getattr(optimizer, "averaged_gradients", None)
    partitions = []
    if isinstance(held, dict):
        partitions = [t for group in held.values() if group for t in group]
    elif isinstance(held, list):
        partitions = [t for group in held if group for t in (group if isinstance(group, list) else [group])]
    grads = [p.grad for p in module.parameters()] + [p.grad for p in flat] + partitions
    states = [v for slots in inner.state.values() for v in slots.values() if torch.is_tensor(v) and v.ndim > 0]
    seen: set[int] = set()
    sizes = {}
    for key, group in (("params", param_ptrs), ("optimizer", storages(states)), ("master", storages(master)),
                       ("grads", storages(grads))):
        group = {p: n for p, n in group.items() if p not in seen}
        seen.update(group)
        sizes[key] = sum(group.values())
    return sizes


def fsdp_accumulated(module: Any) -> int:
    """Bytes of the unsharded gradients FSDP2 keeps between micro-steps while gradient sync is off (each unsharded
    parameter's gradient, or its upcast copy in the reduce dtype)."""
    from torch.distributed.fsdp import FSDPModule

    held = []
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            held += [getattr(fsdp_param, "unsharded_accumulated_grad", None), fsdp_param._unsharded_param.grad]
    return sum(storages([t for t in held if t is not None]).values())


def measure(name: str, world: Any) -> dict[str, Any]:
    import numpy as np
    import torch

    from polytrain import registry, validation

    spec = validation.from_dict({**CASES[name][1], "output": tempfile.mkdtemp(prefix="polytrain-plan-"), "seed": 0})
    # a ZeRO-3 engine replaces torch's linear for the rest of the process (DeepSpeed's memory-efficient linear,
    # which saves other tensors for backward than autocast's): each case gets it back, as its own run would have
    linear = torch.nn.functional.linear
    backend = registry.create_backend(spec, world)
    backend.setup()
    try:
        data = registry.open_data(spec)
        fw = registry.create_framework(spec, world, backend)
        fw.build(data.info)
        batch = spec.data.batch_size
        x, y = data.train.read(np.arange(batch * world.rank, batch * (world.rank + 1)) % len(data.train))
        module = backend.unwrap(fw.model)
        result: dict[str, Any] = {}
        accum = spec.loop.grad_accum_steps
        for step in range(3):
            counter = collective_counter() if step == 2 else None
            peak = 0
            with counter if counter is not None else _nothing():
                for micro in range(accum):  # gradients synchronised on the last micro-step only, as fit does
                    saved = SavedPeak(module)
                    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                        fw.train_micro_step(x, y, 1.0 / (batch * accum), sync=micro == accum - 1)
                    peak = max(peak, saved.peak)
                    if step == 2 and micro == 0 and accum > 1 and spec.backend == "fsdp":
                        held = fsdp_accumulated(module)
                if step == 2:
                    gc.collect()
                    result = {"states": model_states(module, fw.optimizer), "activations": peak}
                    if accum > 1 and spec.backend == "fsdp":
                        result["accumulating"] = held
                fw.optimizer_step(1e-3, None)
            if counter is not None:
                result["comm"], result["calls"] = counter.bytes, counter.calls
        return result
    finally:
        fw = None
        backend.teardown()
        torch.nn.functional.linear = linear


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def predicted(name: str) -> list[dict[str, Any]]:
    """What `polytrain plan` predicts for each rank of case ``name`` (the planner's own functions), in the
    measurement's terms."""
    from polytrain import validation
    from polytrain.plan.candidates import spec_layout
    from polytrain.plan.census import take_census
    from polytrain.plan.command import predict

    world, raw = CASES[name]
    spec = validation.from_dict(raw)
    layout = spec_layout(spec, world)
    census = take_census(spec, world, degrees=(layout.tensor,) if layout.tensor > 1 else ())
    out = []
    for rank in range(world):
        pred = predict(spec, census, layout, world, NODES[world], rank=rank)
        out.append({"states": {"params": pred.params, "grads": pred.grads, "optimizer": pred.optimizer,
                               "master": pred.master}, "activations": pred.activations, "comm": pred.comm,
                    "accumulating": pred.temporary.get("unsharded gradients (accumulation)"),
                    "host": pred.host, "offloaded": OFFLOADED.get(layout.offload, ())})
    return out


#: a layout's offload → the model-state parts it keeps in host memory: DeepSpeed's optimizer offload the fp32
#: partition, its gradient and the optimizer state, with the parameters' offload their partitions too; FSDP's all
OFFLOADED = {"optimizer": ("grads", "optimizer", "master"),
             "optimizer+params": ("params", "grads", "optimizer", "master"),
             "cpu": ("params", "grads", "optimizer", "master")}


def compare(name: str, measured: list[dict[str, Any]]) -> list[tuple[str, int, str, float, float]]:
    """(case, rank, quantity, predicted, measured) for every rank: each model-state part and their sum, the
    bytes offloaded to host memory, the activations, and each collective kind's bytes. On a CPU the host is the
    device, so what an offloading layout holds in host memory is told apart by what it is (`OFFLOADED`), and
    the copies between them are no collective (the prediction's ``host`` traffic is left out)."""
    rows = []
    for rank, (want, got) in enumerate(zip(predicted(name), measured)):
        states = {part: 0 if part in want["offloaded"] else n for part, n in got["states"].items()}
        for part in ("params", "grads", "optimizer", "master"):
            rows.append((name, rank, part, want["states"][part], states[part]))
        rows.append((name, rank, "model states", sum(want["states"].values()), sum(states.values())))
        if want["offloaded"]:
            host = sum(n for part, n in got["states"].items() if part in want["offloaded"])
            rows.append((name, rank, "host", want["host"], host))
        rows.append((name, rank, "activations", want["activations"], got["activations"]))
        if want["accumulating"] is not None or "accumulating" in got:
            rows.append((name, rank, "accumulating", want["accumulating"] or 0.0, got.get("accumulating", 0)))
        kinds = {k for k in want["comm"] if k not in ("host", "drive")}
        for kind in sorted(kinds | {k for k in got["comm"] if k not in ("p2p_received", "control")}):
            rows.append((name, rank, f"comm {kind}", want["comm"].get(kind, 0.0), got["comm"].get(kind, 0)))
    return rows


def main(out: str, names: list[str]) -> None:
    """Measure each case in turn; each rank writes ``OUT.<rank>.json`` ({case: its numbers}). One process group
    serves every case (a backend's ``setup`` finds it and its ``teardown`` leaves it), as a rendezvous per case
    would meet in the same store keys."""
    import torch.distributed as dist

    from polytrain.adapters.torch.rendezvous import import_before_group
    from polytrain.environments import detect_world

    import_before_group()
    if any(CASES[name][1]["backend"] == "deepspeed" for name in names):
        import torch

        from polytrain.adapters.torch.deepspeed import _prepare_environment

        _prepare_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        import deepspeed  # noqa: F401 - its comm module's defaults are bound at import: before the group
    world = detect_world()
    dist.init_process_group("gloo")
    try:
        results = {name: measure(name, world) for name in names}
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{world.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
    from polytrain.cli import exit_after_training

    exit_after_training()

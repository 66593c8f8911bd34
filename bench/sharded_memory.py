"""Per-rank memory of DDP, ZeRO-1/2/3 and FSDP full_shard, measured, next to the ZeRO formulas.

Run:  python bench/sharded_memory.py [--model mlp|transformer] [BACKEND ...]
      (2 ranks per backend under torchrun; all five: ~1-5 min on 2 cores)

A ~10.5 M-parameter MLP, or with ``--model transformer`` the zoo's transformer LM of the same
size (Ψ parameters), Adam, fp32, 2 ranks (N). In the second step,
after the backward pass and before the optimizer step (gradients and Adam state both
alive), each rank takes a census of every tensor storage Python can reach and sorts
it into parameters, gradients, optimizer state (Adam's two moments, plus the fp32
master copy DeepSpeed keeps of its partition) and other (communication buckets).

The formulas, for fp32 Adam = 4Ψ parameters + 4Ψ gradients + 8Ψ moments = 16Ψ:
DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N (FSDP full_shard: as ZeRO-3).
DeepSpeed keeps an fp32 master copy of each rank's partition (+4Ψ/N), which the formula (written
for mixed precision, where that copy is part of the 12 bytes of optimizer state) does not count for
fp32; polytrain's deepspeed backend makes it share the model's fp32 partition in fp32 training without
offload, so it should read 0 here. Both ratios are printed (without and with that copy).
Measured (2 cores, DeepSpeed 0.19.8): ratio DDP 1.000, ZeRO-1 0.934, ZeRO-2 1.120, ZeRO-3 1.000,
FSDP 1.000. ZeRO-1 and ZeRO-2 hold the same bytes: DeepSpeed's stage 1 also keeps only the
gradients its partition needs. In fp32 (0.19.8) those are views into the full gradients of the
parameters that lie in the partition, so a parameter straddling the partition boundary is held
whole by both ranks: here one 2048×2048 matrix (16 MiB), 12 MiB over ZeRO-2's 4Ψ/N on rank 1.
The excess is at most the largest parameter, so it shrinks with finer-grained models: with
``--model transformer`` (10.5 M parameters in mid-sized matrices) DDP 1.000, ZeRO-1 0.841, ZeRO-2
1.009, ZeRO-3 1.000, FSDP 1.000 (ZeRO-1 under its formula, which counts full gradients on every rank).
"other" is every further tensor storage created by the backend (communication buckets):
ZeRO-3 allocates a reduce bucket of ``reduce_bucket_size`` (5e8 elements by default) that
is mostly never touched, so it shows up there but hardly in RSS. Peak RSS is the
process's high-water mark (includes the Python/torch runtime); "RSS Δ" is its growth
from just before the model was built.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = (2048, 2048, 2048)
IN_FEATURES, CLASSES, BATCH, NPROC = 1024, 16, 8, 2
#: the zoo's transformer LM at ~10.5 M parameters (tied head): many mid-sized matrices instead of three large ones
LM, VOCAB, SEQ = {"d_model": 512, "n_heads": 8, "n_layers": 3}, 2048, 64
MODELS = {"mlp": f"MLP {IN_FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}",
          "transformer": f"transformer LM {LM}, vocab {VOCAB}, {SEQ} tokens"}
REPO = Path(__file__).resolve().parents[1]

BACKENDS = {  # name → spec settings
    "ddp": {"backend": "ddp"},
    "zero1": {"backend": "deepspeed", "deepspeed": {"stage": 1}},
    "zero2": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
    "zero3": {"backend": "deepspeed", "deepspeed": {
        "stage": 3, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}},
    "fsdp": {"backend": "fsdp", "fsdp": {"sharding": "full_shard"}},
}
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}  # the ZeRO stage each backend's states follow
MASTER = {"zero1": 4, "zero2": 4, "zero3": 4}  # DeepSpeed's fp32 partition copy, bytes per parameter / N


def formula(name: str, n: int) -> float:
    """Bytes per parameter, fp32 Adam (`polytrain.plan.memory.zero_paper_bytes`: the planner's formula)."""
    from polytrain.plan.memory import zero_paper_bytes

    return zero_paper_bytes(STAGES[name], n)


def make_spec(name: str, out: str, model: str = "mlp"):  # noqa: ANN201 - a TrainSpec
    from polytrain import validation

    raw = {**BACKENDS[name], "output": out, "seed": 0, "optimizer": {"name": "adam", "lr": 1e-3},
           "model": {"name": "mlp", "params": {"hidden_sizes": list(HIDDEN)}}, "data": {"batch_size": BATCH}}
    if model == "transformer":
        raw["model"] = {"name": "transformer", "params": LM}
        raw["data"] = {"name": "tokens", "batch_size": BATCH, "tokens": {"vocab": VOCAB, "seq_len": SEQ}}
    return validation.from_dict(raw)


def _local(t):  # noqa: ANN001, ANN202 - a DTensor's shard, or the tensor itself
    return getattr(t, "_local_tensor", t)


def storages(tensors) -> dict[int, int]:  # noqa: ANN001
    """The distinct storages under ``tensors`` (DTensors by their local shard; None and meta tensors skipped):
    data pointer → bytes."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def census() -> dict[int, int]:
    """Every tensor storage reachable from Python: data pointer → bytes."""
    import torch

    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                found.append(obj)
        except ReferenceError:
            continue
    return storages(found)


def inner_optimizer(optimizer):  # noqa: ANN001, ANN202 - DeepSpeed wraps the torch optimizer
    """The torch optimizer inside the wrappers around it."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _grad_partitions(optimizer) -> list:  # noqa: ANN001
    """DeepSpeed's reduced gradient partitions (held by its ZeRO optimizer, not by ``.grad``)."""
    held = getattr(optimizer, "averaged_gradients", None)
    if isinstance(held, dict):
        return [t for group in held.values() if group for t in group]
    if isinstance(held, list):
        return [t for group in held if group for t in (group if isinstance(group, list) else [group])]
    return []


def classify(fw, backend, before: dict[int, int]) -> dict[str, int]:  # noqa: ANN001
    import torch

    module = backend.unwrap(fw.model)
    params = [p for p in module.parameters()] + [p.ds_tensor for p in module.parameters() if hasattr(p, "ds_tensor")]
    inner = inner_optimizer(fw.optimizer)
    param_ptrs = storages(params)
    flat = [p for g in inner.param_groups for p in g["params"]]
    flat += list(getattr(fw.optimizer, "fp32_partitioned_groups_flat", []))  # ZeRO-3 keeps them out of the groups
    master = [p for p in flat if _local(p).untyped_storage().data_ptr() not in param_ptrs]
    grads = [p.grad for p in module.parameters()] + [p.grad for p in flat] + _grad_partitions(fw.optimizer)
    states = [v for slots in inner.state.values() for v in slots.values() if torch.is_tensor(v) and v.ndim > 0]
    seen: set[int] = set()
    sizes = {}
    for key, group in (("params", param_ptrs), ("optimizer_state", storages(states)),
                       ("master_copy", storages(master)), ("grads", storages(grads))):
        group = {p: n for p, n in group.items() if p not in seen}
        seen.update(group)
        sizes[key] = sum(group.values())
    everything = census()
    sizes["other"] = sum(n for p, n in everything.items() if p not in seen and p not in before)
    return sizes


def worker(name: str, out_file: str, model: str) -> None:
    import numpy as np

    from polytrain import registry
    from polytrain.data.source import DatasetInfo
    from polytrain.environments import detect_world

    world = detect_world()
    tmp = tempfile.mkdtemp(prefix="polytrain-mem-")
    spec = make_spec(name, tmp, model)
    backend = registry.create_backend(spec, world)
    backend.setup()
    fw = registry.create_framework(spec, world, backend)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = census()
    rng = np.random.default_rng(world.rank)
    if model == "transformer":
        fw.build(DatasetInfo(input_shape=(SEQ,), num_outputs=VOCAB, task="next_token"))
        x, y = rng.integers(0, VOCAB, (BATCH, SEQ)), rng.integers(0, VOCAB, (BATCH, SEQ))
    else:
        fw.build(DatasetInfo(input_shape=(IN_FEATURES,), num_outputs=CLASSES, task="classification"))
        x, y = rng.standard_normal((BATCH, IN_FEATURES)).astype(np.float32), rng.integers(0, CLASSES, BATCH)
    n_params = sum(p.numel() for p in backend.unwrap(fw.model).parameters() if not hasattr(p, "ds_tensor"))
    n_params += sum(p.ds_numel for p in backend.unwrap(fw.model).parameters() if hasattr(p, "ds_tensor"))
    sizes = {}
    for step in range(2):
        fw.train_micro_step(x, y, world.size / (BATCH * world.size), sync=True)
        if step == 1:
            sizes = classify(fw, backend, before)
        fw.optimizer_step(1e-3, None)
    sizes["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sizes["rss_at_build"] = rss_before
    sizes["params_count"] = n_params
    gathered = backend.all_gather_object(sizes)
    if world.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    backend.teardown()


def launch(name: str, out_file: Path, model: str) -> list[dict]:
    from polytrain.net import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={NPROC}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, "--worker", name, str(out_file), model]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=900)
    return json.loads(out_file.read_text())


def main(argv: list[str]) -> None:
    mib = 2**20
    rows = []
    model = "mlp"
    if argv[:1] == ["--model"]:
        if len(argv) < 2 or argv[1] not in MODELS:
            sys.exit(f"sharded_memory.py: --model must be one of {', '.join(MODELS)}")
        model, argv = argv[1], argv[2:]
    names = argv
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        sys.exit(f"sharded_memory.py: unknown backend(s) {', '.join(unknown)}; allowed: {', '.join(BACKENDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or BACKENDS:
            ranks = launch(name, Path(tmp) / f"{name}.json", model)
            rows.append((name, ranks))
    psi = rows[0][1][0]["params_count"]
    print(f"Ψ = {psi:,} parameters ({MODELS[model]}), Adam, fp32, "
          f"N = {NPROC} ranks; per rank, MiB (max over ranks)")
    head = (f"{'backend':8} {'params':>8} {'grads':>8} {'adam':>8} {'master':>8} {'total':>8} {'formula':>8} "
            f"{'ratio':>6} {'+master':>8} {'ratio':>6} {'other':>8} {'peak RSS':>9} {'RSS Δ':>8}")
    print(head)
    for name, ranks in rows:
        worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
        total = worst["params"] + worst["grads"] + worst["optimizer_state"] + worst["master_copy"]
        expected = formula(name, NPROC) * psi
        with_master = expected + MASTER.get(name, 0) * psi / NPROC
        print(f"{name:8} {worst['params'] / mib:8.1f} {worst['grads'] / mib:8.1f} "
              f"{worst['optimizer_state'] / mib:8.1f} {worst['master_copy'] / mib:8.1f} {total / mib:8.1f} "
              f"{expected / mib:8.1f} {total / expected:6.3f} {with_master / mib:8.1f} {total / with_master:6.3f} "
              f"{worst['other'] / mib:8.1f} {worst['peak_rss'] / mib:9.0f} "
              f"{(worst['peak_rss'] - worst['rss_at_build']) / mib:8.0f}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        from polytrain.cli import exit_after_training

        worker(sys.argv[2], sys.argv[3], sys.argv[4])
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    else:
        main(sys.argv[1:])

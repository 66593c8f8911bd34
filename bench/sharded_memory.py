"""Per-rank memory of DDP, ZeRO-1/2/3 and FSDP full_shard, measured, next to the ZeRO formulas.

Run:  python bench/sharded_memory.py [--model mlp|transformer] [BACKEND ...]
      (2 ranks per backend under torchrun; all five: ~1-5 min on 2 cores)
      python bench/sharded_memory.py [--model ...] --offload [LAYOUT ...]   (ZeRO-3 offload rows, ~1 min)

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
``--offload``: ZeRO-3 without offload, with the optimizer in host memory (cpu), on a drive (nvme: a directory of
the temporary folder), and the parameters too (nvme-all; -2buf with the parameter swapper's buffers cut to two of
the largest partition). Per rank: the model states a census finds resident after the backward pass against the
formula (`OFFLOAD_FORMULA`), what goes on the drive, RSS, the bytes this process read and wrote to storage per
step (``/proc/self/io``: DeepSpeed's I/O threads included), the step time. Measured (2 cores, ext4, DeepSpeed
0.19.8): resident 80.3 / 100.5 / 20.2 / 20.2 / 20.2 MiB (ratios 1.000, 1.001, 1.007, 1.007, 1.007); per step
80.2 MiB read and 80.2 MiB written with nvme = the fp32 master, both moments and the gradients (16Ψ/N), the same
with nvme-all: DeepSpeed keeps the parameters in host memory too (``max_in_cpu``, 1e9 elements by default), so
their copy on the drive is written once and not read back here; step time ×1.19 (cpu), ×1.94 (nvme), ×1.86
(nvme-all), ×2.39 (-2buf) of ZeRO-3 without offload. RSS: the parameter swapper's default buffers (5 × 1e8 fp32
elements) cost 1.9 GB per rank (2813 vs 897 MiB with two buffers of the largest partition). A smaller
``max_in_cpu`` (0) stopped at start in DeepSpeed's swapper ("Not enough buffers") with 2 and 4 buffers here.
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
import time
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
#: ``--offload``: ZeRO-3 with its states in host memory or on a drive (ZeRO-Offload, ZeRO-Infinity; a directory
#: of the bench's temporary folder stands in for the NVMe drive)
OFFLOAD = {
    "zero3": BACKENDS["zero3"],
    "zero3+cpu": {"backend": "deepspeed", "deepspeed": {"stage": 3, "offload_optimizer": "cpu"}},
    "zero3+nvme": {"backend": "deepspeed", "deepspeed": {"stage": 3, "offload_optimizer": "nvme"}},
    "zero3+nvme-all": {"backend": "deepspeed", "deepspeed": {"stage": 3, "offload_optimizer": "nvme",
                                                             "offload_param": "nvme"}},
    # the parameter swapper's buffers cut from DeepSpeed's 5 × 1e8 elements (2 GB in fp32) to 2 of the largest
    # partition; DeepSpeed still keeps the parameters in host memory up to offload_param.max_in_cpu (1e9 elements)
    "zero3+nvme-all-2buf": {"backend": "deepspeed", "deepspeed": {
        "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "config": {"zero_optimization": {"offload_param": {"buffer_count": 2, "buffer_size": 2048 * 2048 // 2}}}}},
}
#: fp32 Adam model states per parameter / N: (resident in host memory, on the drive). DeepSpeed keeps a separate fp32
#: master partition once the optimizer is offloaded; on the drive go the master, both moments and (while it steps)
#: the gradients, and with offload_param a copy of the parameters' partitions, which stay in host memory too
#: (up to max_in_cpu elements)
OFFLOAD_FORMULA = {"zero3": (16, 0), "zero3+cpu": (20, 0), "zero3+nvme": (4, 16), "zero3+nvme-all": (4, 20),
                   "zero3+nvme-all-2buf": (4, 20)}
OFFLOAD_STEPS = 6  # the first two warm up; I/O and time are averaged over the rest
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}  # the ZeRO stage each backend's states follow
MASTER = {"zero1": 4, "zero2": 4, "zero3": 4}  # DeepSpeed's fp32 partition copy, bytes per parameter / N


def formula(name: str, n: int) -> float:
    """Bytes per parameter, fp32 Adam (`polytrain.plan.memory.zero_paper_bytes`: the planner's formula)."""
    from polytrain.plan.memory import zero_paper_bytes

    return zero_paper_bytes(STAGES[name], n)


def make_spec(name: str, out: str, model: str = "mlp"):  # noqa: ANN201 - a TrainSpec
    from polytrain import validation

    settings = {**BACKENDS, **OFFLOAD}[name]
    if "nvme" in name:
        settings = {**settings, "deepspeed": {**settings["deepspeed"], "nvme_path": str(Path(out) / "nvme")}}
    raw = {**settings, "output": out, "seed": 0, "optimizer": {"name": "adam", "lr": 1e-3},
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
    sizes: dict = {}
    io, seconds = [], []
    for step in range(OFFLOAD_STEPS if name in OFFLOAD else 2):
        io_before, start = disk_io(), time.perf_counter()
        fw.train_micro_step(x, y, world.size / (BATCH * world.size), sync=True)
        if step == 1:
            sizes = classify(fw, backend, before)
        fw.optimizer_step(1e-3, None)
        if step >= 2:
            seconds.append(time.perf_counter() - start)
            io.append([after - was for after, was in zip(disk_io(), io_before)])
    if io:
        sizes["read_per_step"], sizes["written_per_step"] = (sum(col) / len(io) for col in zip(*io))
        sizes["step_seconds"] = sum(seconds) / len(seconds)
        sizes["rss_now"] = resident()
    sizes["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sizes["rss_at_build"] = rss_before
    sizes["params_count"] = n_params
    gathered = backend.all_gather_object(sizes)
    if world.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    backend.teardown()


def disk_io() -> tuple[int, int]:
    """Bytes this process (all its threads: DeepSpeed's I/O threads too) read from and wrote to storage."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def resident() -> int:
    """This process's resident memory now (bytes)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def launch(name: str, out_file: Path, model: str) -> list[dict]:
    from polytrain.comm.net import free_port

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
    table = BACKENDS
    if argv[:1] == ["--offload"]:
        table, argv = OFFLOAD, argv[1:]
    names = argv
    unknown = sorted(set(names) - set(table))
    if unknown:
        sys.exit(f"sharded_memory.py: unknown backend(s) {', '.join(unknown)}; allowed: {', '.join(table)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or table:
            ranks = launch(name, Path(tmp) / f"{name}.json", model)
            rows.append((name, ranks))
    psi = rows[0][1][0]["params_count"]
    if table is OFFLOAD:
        return offload_table(rows, psi, model)
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


def offload_table(rows: list, psi: int, model: str) -> None:
    mib = 2**20
    print(f"Ψ = {psi:,} parameters ({MODELS[model]}), Adam, fp32, N = {NPROC} ranks; per rank (max over ranks): "
          f"model states resident in host memory (census) vs the formula, on the drive (formula), disk I/O and "
          f"time per step (mean of steps 3-{OFFLOAD_STEPS}), the step time against zero3 without offload")
    print(f"{'layout':19} {'resident':>9} {'formula':>8} {'ratio':>6} {'on drive':>9} {'RSS now':>8} "
          f"{'read/step':>10} {'write/step':>10} {'step s':>7} {'× zero3':>8}")
    base = None
    for name, ranks in rows:
        worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
        held = worst["params"] + worst["grads"] + worst["optimizer_state"] + worst["master_copy"]
        host, drive = (b * psi / NPROC for b in OFFLOAD_FORMULA[name])
        base = worst["step_seconds"] if name == "zero3" else base
        against = f"{worst['step_seconds'] / base:8.2f}" if base else f"{'-':>8}"
        ratio = f"{held / host:6.3f}" if host else f"{'-':>6}"
        print(f"{name:19} {held / mib:9.1f} {host / mib:8.1f} {ratio} {drive / mib:9.1f} "
              f"{worst['rss_now'] / mib:8.0f} {worst['read_per_step'] / mib:10.1f} "
              f"{worst['written_per_step'] / mib:10.1f} {worst['step_seconds']:7.3f} {against}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        from polytrain.cli import exit_after_training

        worker(sys.argv[2], sys.argv[3], sys.argv[4])
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    else:
        main(sys.argv[1:])

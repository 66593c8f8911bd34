"""Worker programs for the TensorFlow multi-process tests, started by real launchers (mpirun, polytrain launch).

``python tf_workers.py reference SPEC OUT``  — one process: the spec with 2×batch, then with
2 micro-steps of batch (the references 2 ranks × batch must match).

``python tf_workers.py parity RAW_JSON TORCH_BACKEND TF_BACKEND STEPS OUT_JSON`` — every rank builds
the PyTorch and the TensorFlow adapter directly, gives TensorFlow PyTorch's initial weights and
trains both on the same batches with the Trainer's own plan, schedule and loss scaling; rank 0
writes both per-step loss curves (averaged over ranks) to OUT_JSON.

``python tf_workers.py exchange OUT`` — one process: a PyTorch-trained convnet evaluated in
TensorFlow, and a TensorFlow-trained one evaluated in PyTorch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from polytrain import registry
from polytrain import spec as spec_mod
from polytrain.checkpoint import read_model, state_digest
from polytrain.data import epoch_plan, global_batch_size, load_dataset, steps_per_epoch
from polytrain.environments import detect_world
from polytrain.schedule import lr_at
from polytrain.trainer import Trainer
from polytrain.world import World


def reference(spec_path: str, out: str) -> None:
    batch = spec_mod.load(spec_path).data.batch_size
    for name, sets in (("big", [f"data.batch_size={2 * batch}"]), ("accum", ["loop.grad_accum_steps=2"])):
        spec = spec_mod.load(spec_path, [*sets, f"output={out}/{name}"])
        Trainer(spec, World(), show_progress=False).fit()


def train_steps(fw: Any, backend: Any, spec: spec_mod.TrainSpec, data: Any, world: World, steps: int) -> list[float]:
    """The Trainer's loop body for ``steps`` steps; the per-step mean loss over all ranks."""
    accum = spec.loop.grad_accum_steps
    global_batch = global_batch_size(spec.data, world.size, accum)
    per_epoch = steps_per_epoch(len(data.x_train), global_batch)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        for plan in epoch_plan(len(data.x_train), seed=spec.seed, epoch=epoch, global_batch=global_batch,
                               world_size=world.size, rank=world.rank, accum=accum):
            if len(losses) == steps:
                break
            window = np.zeros(2)
            last = len(plan.micro_batches) - 1
            for m, idx in enumerate(plan.micro_batches):
                loss = fw.train_micro_step(data.x_train[idx], data.y_train[idx], world.size / plan.global_count,
                                           sync=m == last)
                window += (loss, len(idx))
            lr = lr_at(len(losses), optimizer=spec.optimizer, schedule=spec.schedule, world_size=world.size,
                       steps_per_epoch=per_epoch, total_steps=steps)
            fw.optimizer_step(lr, spec.loop.grad_clip_norm)
            total, count = backend.all_reduce(window)
            losses.append(float(total / count))
        epoch += 1
    return losses


def parity(raw_json: str, torch_backend: str, tf_backend: str, steps: str, out_json: str) -> None:
    runs = json.loads(raw_json)  # {"label": {spec fields}, ...}
    world = detect_world()
    backends = {}
    for framework, name in (("torch", torch_backend), ("tensorflow", tf_backend)):
        spec = spec_mod.from_dict({"framework": framework, "backend": name})
        backends[framework] = registry.create_backend(spec, world)
        backends[framework].setup()
    results: dict[str, Any] = {"world_size": world.size, "launcher": world.launcher,
                               "backends": {k: b.name for k, b in backends.items()}}
    for label, raw in runs.items():
        curves, start_digests = {}, {}
        initial = None
        for framework in ("torch", "tensorflow"):
            spec = spec_mod.from_dict({**raw, "framework": framework, "backend": backends[framework].name})
            data = load_dataset(spec.data, spec.seed)
            fw = registry.create_framework(spec, world, backends[framework])
            fw.build(data.info)
            if initial is None:
                initial = fw.export_state()
            else:
                fw.load_state(initial)
            start_digests[framework] = state_digest(fw.export_state())
            curves[framework] = train_steps(fw, backends[framework], spec, data, world, int(steps))
        results[label] = {"curves": curves, "same_start": start_digests["torch"] == start_digests["tensorflow"]}
    for backend in backends.values():
        backend.teardown()
    if world.rank == 0:
        Path(out_json).write_text(json.dumps(results))


def exchange(out: str) -> None:
    """Train one framework, evaluate its saved model in the other; results in OUT/exchange.json."""
    base = {"model": {"name": "convnet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "loop": {"epochs": 2}}
    results = {}
    for trained, other in (("torch", "tensorflow"), ("tensorflow", "torch")):
        spec = spec_mod.from_dict({**base, "framework": trained, "output": f"{out}/{trained}"})
        Trainer(spec, World(), show_progress=False).fit()
        state, manifest = read_model(Path(spec.output))
        other_spec = spec_mod.from_dict({**base, "framework": other})
        data = load_dataset(other_spec.data, other_spec.seed)
        backend = registry.create_backend(other_spec, World())
        backend.setup()
        fw = registry.create_framework(other_spec, World(), backend)
        fw.build(data.info)
        fw.load_state(state)
        correct, count = fw.evaluate(data.x_val, data.y_val)["accuracy"]
        results[trained] = {"trained_accuracy": manifest["val_accuracy"], "other_accuracy": correct / count,
                            "round_trip_identical": state_digest(fw.export_state()) == state_digest(state)}
    Path(out, "exchange.json").write_text(json.dumps(results))


if __name__ == "__main__":
    {"reference": reference, "parity": parity, "exchange": exchange}[sys.argv[1]](*sys.argv[2:])

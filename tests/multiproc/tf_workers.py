"""Worker programs for the TensorFlow multi-process tests, started by real launchers (mpirun, polytrain launch).

``python tf_workers.py reference SPEC OUT``  — one process: the spec with 2×batch, then with
2 micro-steps of batch (the references 2 ranks × batch must match).

``python tf_workers.py parity RAW_JSON TORCH_BACKEND TF_BACKEND STEPS OUT`` — every rank runs the
Trainer, as ``polytrain train`` does, for each spec in RAW_JSON: on PyTorch, then on TensorFlow
resumed (``--resume``) from PyTorch's initial weights imported as a step-0 checkpoint (what
``polytrain checkpoint import`` writes from a state_dict file), STEPS steps each; see `parity`.

``python tf_workers.py exchange OUT`` — one process: a PyTorch-trained convnet evaluated in
TensorFlow, and a TensorFlow-trained one evaluated in PyTorch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from polytrain import registry, validation
from polytrain.checkpoint.store import read_model, state_digest
from polytrain.commands.checkpoint import import_weights
from polytrain.data import load_dataset
from polytrain.environments import detect_world
from polytrain.train.callbacks import RunInfo
from polytrain.train.trainer import Trainer
from polytrain.world import World


def reference(spec_path: str, out: str) -> None:
    batch = validation.load(spec_path).data.batch_size
    for name, sets in (("big", [f"data.batch_size={2 * batch}"]), ("accum", ["loop.grad_accum_steps=2"])):
        spec = validation.load(spec_path, [*sets, f"output={out}/{name}"])
        Trainer(spec, World(), show_progress=False).fit()


class StartAndLosses:
    """A callback that records what this rank saw: the weights it started from (a digest) and every
    step's loss (logged every step, the same on every rank). ``init``: on rank 0, also save those
    weights as a step-0 checkpoint there, as ``polytrain checkpoint import`` does with a state_dict file."""

    def __init__(self, init: Path | None = None) -> None:
        self.trainer: Trainer | None = None
        self.init = init
        self.start_digest = ""
        self.losses: list[float] = []

    def on_train_start(self, run: RunInfo) -> None:
        state = self.trainer.framework.export_state()
        self.start_digest = state_digest(state)
        if self.init is not None and run.is_main:
            import torch

            weights = self.init / "initial.pt"
            self.init.mkdir(parents=True)
            torch.save({name: torch.from_numpy(value) for name, value in state.items()}, weights)
            spec_file = self.init / "spec.json"
            spec_file.write_text(json.dumps(run.spec.to_dict()))
            import_weights(weights, spec_file, [], self.init / "checkpoints")

    def on_step_end(self, run: RunInfo, step: int, logs: dict[str, Any]) -> None:
        self.losses.append(float(logs["loss"]))


def parity(raw_json: str, torch_backend: str, tf_backend: str, steps: str, out: str) -> None:
    """For each run: the Trainer on PyTorch, then on TensorFlow resumed from PyTorch's initial weights
    (a step-0 checkpoint imported from them), ``steps`` steps each, the loss logged every step. Outputs in
    OUT/<label>/<framework>; what rank r saw in OUT/<label>/rank<r>.json."""
    runs = json.loads(raw_json)  # {"label": {spec fields}, ...}
    world = detect_world()
    for label, raw in runs.items():
        root = Path(out, label)
        seen: dict[str, Any] = {"launcher": world.launcher, "world_size": world.size}
        for framework, backend in (("torch", torch_backend), ("tensorflow", tf_backend)):
            loop = {**raw.get("loop", {}), "max_steps": int(steps), "log_every_n_steps": 1}
            spec = validation.from_dict({**raw, "framework": framework, "backend": backend, "loop": loop,
                                         "output": str(root / framework)})
            recorder = StartAndLosses(root / "init" if framework == "torch" else None)
            resume = str(root / "init" / "checkpoints" / "step-00000000") if framework == "tensorflow" else None
            trainer = Trainer(spec, world, show_progress=False, resume=resume, callbacks=[recorder])
            recorder.trainer = trainer
            trainer.fit()
            seen[framework] = {"start_digest": recorder.start_digest, "losses": recorder.losses}
        Path(root, f"rank{world.rank}.json").write_text(json.dumps(seen))


def exchange(out: str) -> None:
    """Train one framework, evaluate its saved model in the other; results in OUT/exchange.json."""
    base = {"model": {"name": "convnet"}, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "loop": {"epochs": 2}}
    results = {}
    for trained, other in (("torch", "tensorflow"), ("tensorflow", "torch")):
        spec = validation.from_dict({**base, "framework": trained, "output": f"{out}/{trained}"})
        Trainer(spec, World(), show_progress=False).fit()
        state, manifest = read_model(Path(spec.output))
        other_spec = validation.from_dict({**base, "framework": other})
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

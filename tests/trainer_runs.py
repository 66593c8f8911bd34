"""Running the Trainer in-process on the fakes of tests/trainer_fakes.py, for the tests of the Trainer
(test_trainer_*.py), its callbacks and its checkpoints: the spec they share, `fit`/`fit_fails`, and readers of
what a run wrote.

The data: 100 synthetic samples, 20 held out, so 80 training samples; a batch of 12 gives 7 steps per
epoch, the last of 8 samples. Every test asserts numbers the Trainer decides: which samples, which loss
scale, which learning rate, which checkpoint, which record, which message.
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import read_metrics
from safetensors.numpy import load_file
from trainer_fakes import FakeJob, MicroCall

from polytrain.checkpoint import store as ckpt
from polytrain.data import load_dataset
from polytrain.observe.metrics import Progress
from polytrain.spec.tables import TrainSpec
from polytrain.train import trainer as trainer_mod
from polytrain.train.trainer import Trainer, TrainResult
from polytrain.validation import from_dict
from polytrain.world import World

N_TRAIN, N_VAL, BATCH, PER_EPOCH = 80, 20, 12, 7
STEP_SIZES = [12] * 6 + [8]  # samples in each step of an epoch

BASE: dict[str, Any] = {
    "framework": "torch",
    "backend": "local",
    "model": {"name": "mlp", "params": {"hidden_sizes": [4]}},
    "data": {"name": "synthetic", "batch_size": BATCH, "val_fraction": 0.2,
             "synthetic": {"samples": 100, "features": 6, "classes": 3, "noise": 1.5}},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "loop": {"epochs": 2},
    "seed": 3,
}

ONE, TWO = World(), World(rank=0, size=2, local_size=2, launcher="torchrun")


def _merge(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def make_spec(output: Path, **changes: Any) -> TrainSpec:
    """BASE with ``changes`` merged table by table, writing into ``output``."""
    return from_dict(_merge(BASE, {"output": str(output), **changes}))


def fit(spec: TrainSpec, world: World = ONE, *, job: FakeJob | None = None, resume: str | None = None,
        timeline: str | None = None, show_progress: bool = False, verbose: bool = False,
        callbacks: list[Any] | None = None) -> tuple[TrainResult, FakeJob]:
    job = job or FakeJob()
    trainer = Trainer(spec, world, show_progress=show_progress, resume=resume, timeline=timeline, verbose=verbose,
                      backend_factory=job.backend_factory, framework_factory=job.framework_factory,
                      callbacks=callbacks or ())
    return trainer.fit(), job


def fit_fails(spec: TrainSpec, error: type[BaseException], world: World = ONE,
              job: FakeJob | None = None, resume: str | None = None) -> tuple[BaseException, FakeJob]:
    job = job or FakeJob()
    with pytest.raises(error) as info:
        fit(spec, world, job=job, resume=resume)
    return info.value, job


def records(spec: TrainSpec, event: str) -> list[dict[str, Any]]:
    return read_metrics(Path(spec.output), event)


def sample_ids(spec: TrainSpec, calls: list[MicroCall]) -> list[int]:
    """The training-set index of every sample the micro-steps got, in order."""
    x_train = load_dataset(spec.data, spec.seed).x_train
    where = {row.tobytes(): i for i, row in enumerate(x_train)}
    assert len(where) == len(x_train) == N_TRAIN
    return [where[row.tobytes()] for call in calls for row in call.x]


def by_step(calls: list[MicroCall]) -> dict[int, list[MicroCall]]:
    out: dict[int, list[MicroCall]] = {}
    for call in calls:
        out.setdefault(call.step, []).append(call)
    return out


def saved_steps(spec: TrainSpec) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in ckpt.complete_checkpoints(spec.checkpoint_dir)]


def manifest(spec: TrainSpec, step: int) -> dict[str, Any]:
    return json.loads((spec.checkpoint_dir / ckpt.step_dir_name(step) / "manifest.json").read_text())


def final_state(spec: TrainSpec) -> dict[str, np.ndarray]:
    return load_file(str(Path(spec.output) / "model.safetensors"))


def epoch_order(spec: TrainSpec, epoch: int) -> np.ndarray:
    """The README's rule: each epoch's order is a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([spec.seed, epoch]).permutation(N_TRAIN)


def capture_progress(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What the Trainer prints (its Progress binds sys.stderr at import, out of capsys' reach): the
    ``shown`` fixture of tests/conftest.py."""
    stream = io.StringIO()

    def progress(enabled: bool, prefix: str = "") -> Progress:
        return Progress(enabled=enabled, stream=stream, prefix=prefix)

    monkeypatch.setattr(trainer_mod, "Progress", progress)
    return stream

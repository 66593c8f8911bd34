"""What a checkpoint's manifest (and a final model's ``model.json``) records, built in one place for every writer:
the Trainer (`polytrain.train.checkpoints`) and both own loops (`polytrain.loop.checkpoints`, through
`polytrain.torch.checkpoints` and `polytrain.tensorflow.checkpoints`).

A `Writer` says who writes: the framework, backend, world size, the run (its id: whose checkpoints a save may
replace and prune), its tracker runs, and the spec when there is one. `identity` is what every manifest and
``model.json`` records of it; `manifest` adds where a checkpoint stands (epoch, position in it, every rank's RNG
state, the loss scaler) and what its writer records beside (``**more``: the Trainer's global batch, learning rate,
early stopping and data fingerprint; a loop's ``origin``, precision and ``loop_state``). The checks on what is read
back are `polytrain.checkpoint.manifest`'s; `polytrain.checkpoint.store.save_checkpoint` adds the format version,
``global_step``, the tensor files and the digest.

A loop's checkpoint knows no spec (``model_digest`` None, no ``spec``): whoever loads one checks its tensors
against the model by name and shape instead (`check_names`); ``origin`` (`ORIGIN`) tells it from the Trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.checkpoint.manifest import CheckpointError
from polytrain.checkpoint.store import RUN_KEY
from polytrain.comm.agree import library_versions
from polytrain.spec.tables import TrainSpec
from polytrain.version import __version__

#: the ``origin`` of a hand-written loop's checkpoint (the Trainer's has none)
ORIGIN = "own-loop"


@dataclass(frozen=True)
class Writer:
    """Who writes a checkpoint or a final model. ``spec``: the Trainer's (recorded whole, with its digests); a
    loop's checkpoint has none."""

    framework: str
    backend: str
    world_size: int
    run_id: str
    #: the run's tracker runs by tracker name (W&B, MLflow), so that a resume goes on logging to them
    trackers: Mapping[str, str] = field(default_factory=dict)
    spec: TrainSpec | None = None


def identity(writer: Writer) -> dict[str, Any]:
    """What every manifest and ``model.json`` records of who wrote it."""
    out: dict[str, Any] = {
        "polytrain": __version__, RUN_KEY: writer.run_id, "framework": writer.framework, "backend": writer.backend,
        "world_size": writer.world_size, "versions": library_versions(), "trackers": dict(writer.trackers),
        "model_digest": None if writer.spec is None else writer.spec.model_digest(),
    }
    if writer.spec is not None:
        out.update(spec=writer.spec.to_dict(), spec_digest=writer.spec.digest())
    return out


def manifest(writer: Writer, *, epoch: int, rng_states: list[Any], loss_scaler: Mapping[str, float] | None,
             step_in_epoch: int = 0, samples_in_epoch: int = 0, **more: Any) -> dict[str, Any]:
    """A checkpoint's manifest: `identity`, where it stands (``epoch`` completed, ``step_in_epoch`` and
    ``samples_in_epoch`` into the next: 0 at an epoch's start), every rank's RNG state, the loss scaler's (None
    without one), and what its writer records beside (``more``)."""
    return {**identity(writer), "epoch": epoch, "step_in_epoch": step_in_epoch, "samples_in_epoch": samples_in_epoch,
            "rng_states": rng_states, "loss_scaler": dict(loss_scaler) if loss_scaler else None, **more}


def check_names(path: Path, stored: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], what: str,
                exact: bool = True) -> None:
    """One line unless ``stored`` (name → array) has the ``expected`` names with their shapes (and, when
    ``exact``, no others)."""
    missing = [n for n in expected if n not in stored]
    extra = [n for n in stored if n not in expected] if exact else []
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {_few(missing)}")
        if extra:
            parts.append(f"holds {_few(extra)}, which the {what} does not have")
        raise CheckpointError(f"load: {path} does not fit the {what}: it {' and '.join(parts)} (the names are "
                              f"the portable ones of docs/portable-state.md; build the same model)")
    for name, shape in expected.items():
        have = tuple(np.shape(stored[name]))
        if have != tuple(shape):
            raise CheckpointError(f"load: {path} holds {name} of shape {have}; the {what}'s is {tuple(shape)}")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

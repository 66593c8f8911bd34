"""Checkpoints written and read by a hand-written loop (the own-loop APIs, `polytrain.torch` and
`polytrain.tensorflow`): the Trainer's checkpoints, not a second format.

A loop saves into a checkpoint root as the Trainer does (``<root>/step-NNNNNNNN/``, ``latest``; written
atomically by `polytrain.checkpoint.save_checkpoint`): ``model.safetensors`` and ``optimizer.safetensors`` in
the portable form, plus, when the loop gives any, ``loop.safetensors`` for its own tensors; the manifest has
the keys the Trainer reads (framework, backend, world size, global step, epoch, run id, per-rank RNG, loss
scaler) and ``origin: own-loop``. What the loop keeps beside (plain numbers, strings, lists and dicts) goes in
the manifest's ``loop_state``, as JSON: nothing is pickled.

Meanings shared with the Trainer: ``step`` is the number of optimizer steps taken (the manifest's
``global_step``), ``epoch`` the number of epochs completed (the epoch to go on with), and a loop's checkpoint is
taken at an epoch's start (``step_in_epoch`` 0). A loop's checkpoint knows nothing of a spec's model or data, so
it has no ``model_digest``: the Trainer resuming one checks, instead, that its tensors are its model's by name
and shape (`check_names`), and the other way round a loop loading the Trainer's checkpoint does the same.

Every rank calls save and load (gathering a sharded model's full tensors is collective); rank 0 writes, and
every rank learns at once whether it could (`polytrain.failures.settled`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polytrain import checkpoint as ckpt
from polytrain.failures import library_versions, settled
from polytrain.version import __version__

ORIGIN = "own-loop"
#: what a state given to save may hold besides the model and optimizer: JSON values, kept in the manifest
JSON_TYPES = (bool, int, float, str, type(None))


def is_json(value: Any) -> bool:
    """Whether ``value`` is plain JSON data (numbers, strings, None, and lists/dicts of them)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, JSON_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    return False


def counter(state: Mapping[str, Any], key: str) -> int:
    """``state[key]`` (``step`` or ``epoch``) as a count: an int ≥ 0, 0 when absent."""
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ckpt.CheckpointError(f"save: {key!r} must be a whole number ≥ 0 (the {_MEANING[key]}), got {value!r}")
    return int(value)


_MEANING = {"step": "optimizer steps taken", "epoch": "epochs completed"}


def manifest(*, framework: str, backend: str, world_size: int, epoch: int, run_id: str,
             rng_states: list[Any], loss_scaler: Mapping[str, float] | None, loop_state: Mapping[str, Any],
             precision: str, trackers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The manifest of a loop's checkpoint: the Trainer's keys (`polytrain.run_checkpoints`) and ``origin``;
    ``trackers``: the loop's tracker runs (`LoopSession.tracker_ids`)."""
    return {
        "polytrain": __version__, "origin": ORIGIN, ckpt.RUN_KEY: run_id, "framework": framework, "backend": backend,
        "world_size": world_size, "epoch": epoch, "step_in_epoch": 0, "samples_in_epoch": 0,
        "rng_states": rng_states, "loss_scaler": dict(loss_scaler) if loss_scaler else None,
        "precision": precision, "loop_state": dict(loop_state), "model_digest": None,
        "versions": library_versions(), "trackers": dict(trackers or {}),
    }


def write(backend: Any, rank: int, size: int, root: Path, step: int, tensors: Mapping[str, Mapping[str, np.ndarray]],
          described: Mapping[str, Any], keep_last: int | None, owner: ckpt.Owner) -> Path:
    """Rank 0 writes ``tensors`` (file stem → name → array) as checkpoint ``step`` under ``root``; every rank
    learns whether it could. Returns the checkpoint's directory (the same path on every rank)."""

    def save() -> None:
        try:
            ckpt.save_checkpoint(root, step, {k: v for k, v in tensors.items() if v or k != "loop"},
                                 described,
                                 keep_last=keep_last, abandon_future=False, owner=owner)
        except OSError as exc:
            kept = ckpt.complete_checkpoints(root)
            previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
            raise ckpt.CheckpointError(f"save: cannot write the checkpoint of step {step} under {root} "
                                       f"({exc.strerror or exc}); {previous}") from exc

    settled(backend, size, lambda: save() if rank == 0 else None)
    return root / ckpt.step_dir_name(step)


def find(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a step directory, or a root (its newest checkpoint that verifies)."""
    path = Path(path)
    if not path.is_dir():
        raise ckpt.CheckpointError(f"load: {path} is not a directory; give a checkpoint (step-NNNNNNNN) or the "
                                   f"root that holds them")
    if (path / "manifest.json").exists():
        return path
    latest = ckpt.find_latest(path)
    if latest is None:
        raise ckpt.CheckpointError(f"load: no complete checkpoint in {path}; give a checkpoint directory "
                                   f"(step-NNNNNNNN) or the root that holds one")
    return latest


def read(backend: Any, size: int, path: str | Path) -> tuple[Path, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """Every rank reads the checkpoint ``path`` names (a failure on any rank fails every rank with its line)."""
    def one() -> tuple[Path, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
        found = find(path)
        manifest, tensors = ckpt.load_checkpoint(found)
        return found, manifest, tensors

    return settled(backend, size, one)


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
        raise ckpt.CheckpointError(f"load: {path} does not fit the {what}: it {' and '.join(parts)} (the names are "
                                   f"the portable ones of docs/portable-state.md; build the same model)")
    for name, shape in expected.items():
        have = tuple(np.shape(stored[name]))
        if have != tuple(shape):
            raise ckpt.CheckpointError(f"load: {path} holds {name} of shape {have}; the {what}'s is {tuple(shape)}")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def loop_values(state: Mapping[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
    """The plain values of a state given to save (all but ``skip`` and tensors), checked to be JSON."""
    out = {}
    for key, value in state.items():
        if key in skip:
            continue
        if not is_json(value):
            raise ckpt.CheckpointError(
                f"save: {key!r} is a {type(value).__name__}; a checkpoint holds the model, the optimizer, tensors, "
                "and plain values (numbers, strings, lists, dicts) — nothing is pickled; pass its state_dict() "
                "if that is plain, or its tensors")
        out[key] = value
    json.dumps(out, allow_nan=False)
    return out

"""Checkpoints written and read by a hand-written loop (the own-loop APIs, `polytrain.torch` and
`polytrain.tensorflow`): the Trainer's checkpoints, not a second format.

A loop saves into a checkpoint root as the Trainer does (``<root>/step-NNNNNNNN/``, ``latest``; written
atomically by `polytrain.checkpoint.store.save_checkpoint`): ``model.safetensors`` and ``optimizer.safetensors`` in
the portable form, plus, when the loop gives any, ``loop.safetensors`` for its own tensors; the manifest has
the keys the Trainer reads (framework, backend, world size, global step, epoch, run id, per-rank RNG, loss
scaler) and ``origin: own-loop``. What the loop keeps beside (plain numbers, strings, lists and dicts) goes in
the manifest's ``loop_state``, as JSON: nothing is pickled. Those values come back as they were: the manifest
lists under ``encoded`` the keys it holds in `polytrain.observe.jsonfiles.exact`'s form (infinities and NaN, tuples,
dicts keyed by numbers), and `read` turns them back (a manifest without ``encoded``, from an older polytrain,
holds plain JSON).

Meanings shared with the Trainer: ``step`` is the number of optimizer steps taken (the manifest's
``global_step``), ``epoch`` the number of epochs completed (the epoch to go on with), and a loop's checkpoint is
taken at an epoch's start (``step_in_epoch`` 0). A loop's checkpoint knows nothing of a spec's model or data, so
it has no ``model_digest``: the Trainer resuming one checks, instead, that its tensors are its model's by name
and shape (`polytrain.checkpoint.record.check_names`), and the other way round a loop loading the Trainer's
checkpoint does the same. The manifest is built by the Trainer's builder (`polytrain.checkpoint.record`).

A loop's `Distributed` hands its framework's save and load a `LoopState` (its backend, world, spec, model,
optimizer, loss scaler, loaders, run and tracker runs); a load hands back a `Loaded` (the values, and the run and
tracker runs the loop goes on in), which the `Distributed` takes up itself (`LoopSession._resumed`).

Every rank calls save and load (gathering a sharded model's full tensors is collective); rank 0 writes, and
every rank learns at once whether it could (`polytrain.comm.settle.settled`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.checkpoint import record
from polytrain.checkpoint import store as ckpt
from polytrain.comm.settle import settled
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.spec.tables import TrainSpec
from polytrain.world import World

ORIGIN = record.ORIGIN
#: the manifest's list of its keys held in `jsonfiles.exact`'s form (`read` turns them back)
ENCODED_KEY = "encoded"
#: what a value given to save may be: these, and lists, tuples and dicts of them (`plain`)
PLAIN = "plain values (numbers, strings, lists, dicts)"


@dataclass(frozen=True)
class LoopState:
    """What a loop's save and load work on, handed over by its `Distributed` (built for each call): no module
    reads another's private fields. ``scaler``: torch's fp16 loss scaler (None without one); ``loading``: torch's
    `polytrain.torch.loaders.Loading` (the loaders a load moves to the checkpoint's epoch; None on TensorFlow)."""

    backend: Any
    world: World
    spec: TrainSpec
    model: Any
    optimizer: Any
    #: the run whose checkpoints a save may replace and prune (a fresh one's; a load takes the checkpoint's)
    owner: ckpt.Owner
    #: the loop's tracker runs by tracker name (`LoopSession.tracker_ids`), kept in every checkpoint
    trackers: Mapping[str, str] = field(default_factory=dict)
    scaler: Any = None
    loading: Any = None


@dataclass(frozen=True)
class Loaded:
    """What a load hands back: the checkpoint's plain values (with ``step``, ``epoch``, ``step_in_epoch``), and
    what the loop goes on as: the checkpoint's run (None: it names none) and the tracker runs it kept."""

    values: dict[str, Any]
    owner: ckpt.Owner | None
    trackers: dict[str, str]


def loaded(manifest: Mapping[str, Any]) -> Loaded:
    """The `Loaded` of a checkpoint read (its manifest): its values, its run (its later saves may replace and
    prune its checkpoints) and its tracker runs (a resumed loop logs on in them)."""
    values = dict(manifest.get("loop_state") or {})
    values.update(step=int(manifest.get("global_step", 0)), epoch=int(manifest.get("epoch", 0)),
                  step_in_epoch=int(manifest.get("step_in_epoch", 0)))
    run_id = manifest.get(ckpt.RUN_KEY)
    return Loaded(values, ckpt.Owner(run_id) if run_id else None, dict(manifest.get("trackers") or {}))


def is_json(value: Any) -> bool:
    """Whether ``value`` is plain data a checkpoint keeps exactly (`plain`)."""
    try:
        jsonfiles.exact(value)
    except jsonfiles.NotPlain:
        return False
    return True


def plain(value: Any, where: str) -> Any:
    """``value`` in `jsonfiles.exact`'s form; a one-line `CheckpointError` naming where in it (``where``: its
    name) an object is that is not plain data."""
    try:
        return jsonfiles.exact(value, where)
    except jsonfiles.NotPlain as exc:
        raise ckpt.CheckpointError(
            f"save: {exc.where} is a {exc.kind}; a checkpoint holds the model, the optimizer, tensors, and {PLAIN} "
            "— nothing is pickled; pass its state_dict() if that is plain, or its tensors") from None


def decode(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with the keys it lists under ``encoded`` turned back into the values saved."""
    keys = manifest.get(ENCODED_KEY) or []
    if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
        raise ckpt.CheckpointError(f"load: {path}/manifest.json: {ENCODED_KEY!r} must be a list of its keys, got "
                                   f"{keys!r}")
    for key in keys:
        try:
            manifest[key] = jsonfiles.unexact(manifest.get(key))
        except ValueError as exc:
            raise ckpt.CheckpointError(f"load: {path}/manifest.json: {key!r} holds {exc}, which polytrain does not "
                                       "write") from None
    return manifest


def counter(state: Mapping[str, Any], key: str) -> int:
    """``state[key]`` (``step`` or ``epoch``) as a count: an int ≥ 0, 0 when absent."""
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ckpt.CheckpointError(f"save: {key!r} must be a whole number ≥ 0 (the {_MEANING[key]}), got {value!r}")
    return int(value)


_MEANING = {"step": "optimizer steps taken", "epoch": "epochs completed"}


def manifest(state: LoopState, *, epoch: int, rng_states: list[Any], loop_state: Mapping[str, Any],
             loss_scaler: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The manifest of a loop's checkpoint (`polytrain.checkpoint.record`, the Trainer's builder): the Trainer's
    keys, ``origin``, the precision, and ``loop_state`` (`loop_values`', listed under ``encoded``)."""
    writer = record.Writer(state.spec.framework, state.backend.name, state.world.size,
                           state.owner.run_id or ckpt.new_run_id(), state.trackers)
    return record.manifest(writer, epoch=epoch, rng_states=rng_states, loss_scaler=loss_scaler, origin=ORIGIN,
                           precision=state.spec.precision, loop_state=dict(loop_state), **{ENCODED_KEY: ["loop_state"]})


def write(state: LoopState, root: Path, step: int, tensors: Mapping[str, Mapping[str, np.ndarray]],
          described: Mapping[str, Any], keep_last: int | None) -> Path:
    """Rank 0 writes ``tensors`` (file stem → name → array) as checkpoint ``step`` under ``root``; every rank
    learns whether it could. Returns the checkpoint's directory (the same path on every rank)."""
    backend, rank, size, owner = state.backend, state.world.rank, state.world.size, state.owner

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


def read(state: LoopState, path: str | Path) -> tuple[Path, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """Every rank reads the checkpoint ``path`` names (a failure on any rank fails every rank with its line)."""
    def one() -> tuple[Path, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
        found = find(path)
        manifest, tensors = ckpt.load_checkpoint(found)
        return found, decode(found, manifest), tensors

    return settled(state.backend, state.world.size, one)


def loop_values(state: Mapping[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
    """The plain values of a state given to save (all but ``skip`` and tensors), in `jsonfiles.exact`'s form
    (one line naming the first that is not plain data)."""
    out = {key: plain(value, repr(key)) for key, value in state.items() if key not in skip}
    json.dumps(out, allow_nan=False)
    return out

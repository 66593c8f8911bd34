"""What a checkpoint's ``manifest.json`` and a final model's ``model.json`` may hold, checked before anything
reads them, and the digest that covers each of them.

A manifest is read by `--resume` (the Trainer's `polytrain.train.checkpoints`, the own loops'
`polytrain.torch.checkpoints`/`polytrain.tensorflow.checkpoints`), by ``polytrain checkpoint inspect|convert`` and
by `polytrain.checkpoint.store.find_latest`. Every field any of them reads is checked here first (type, range, length),
so that a damaged or hand-edited manifest is one line naming the field and the file (`CheckpointError`, exit 2),
never a ``KeyError`` or a resume "at step -5". Fields polytrain does not read are not checked.

Names of tensor files (``files``) are plain names inside the checkpoint directory (``model.safetensors``): a path,
``..`` or a name that resolves elsewhere (a symbolic link out of the directory) is refused (`member`).

Integrity: a manifest records the sha256 of its own content under ``manifest_sha256`` (`sealed_text`): the hex
digest of the canonical JSON (keys sorted, no white space, ASCII) of the manifest without that key. Editing any
field, or damage that leaves valid JSON, no longer matches it. The tensor files' hashes are in the manifest, so the
digest covers them too. Manifests written before this digest existed have none: they still load, checked field by
field (a digest that is there must match). ``model.json`` is covered the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polytrain.errors import UserError
from polytrain.observe import jsonfiles as jsonfiles

if TYPE_CHECKING:
    from polytrain.world import World

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DIGEST_KEY = "manifest_sha256"
MODEL_FILE = "model.safetensors"
#: a tensor file's name in ``files``: a plain file name ending in .safetensors (no separator, no leading dot)
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, partial, corrupt, or from an incompatible spec."""


class Invalid(ValueError):
    """One field of a manifest that is not what polytrain reads: the message names the field and what is allowed."""


# ---------------------------------------------------------------------------- the digest


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(manifest: Mapping[str, Any]) -> str:
    """The sha256 of ``manifest``'s canonical content (without its ``manifest_sha256``), as `sealed_text` records it."""
    return hashlib.sha256(_canonical(manifest)).hexdigest()


def sealed_text(manifest: Mapping[str, Any], **dump: Any) -> str:
    """``manifest`` as strict JSON (`polytrain.observe.jsonfiles`; ``dump``: ``json.dumps``' options) with its
    ``manifest_sha256``. The digest is taken of what a reader parses back (numpy scalars as numbers, non-finite
    numbers as null, other objects as their ``str``), so the file matches it as written."""
    plain = json.loads(jsonfiles.dumps({k: v for k, v in manifest.items() if k != DIGEST_KEY}, default=str))
    plain[DIGEST_KEY] = digest(plain)
    return jsonfiles.dumps(plain, **dump)


def _check_digest(manifest: Mapping[str, Any], where: Path) -> None:
    recorded = manifest.get(DIGEST_KEY)
    if recorded is None:
        return  # written before manifests had a digest: checked field by field only
    if not isinstance(recorded, str) or not HEX64.match(recorded):
        raise CheckpointError(f"checkpoint: {where}: {_fail(DIGEST_KEY, 'a sha256 (64 hex digits)', recorded)}")
    if recorded != digest(manifest):
        raise CheckpointError(f"checkpoint: {where} does not match the {DIGEST_KEY} it records: it was edited or "
                              f"damaged after it was written (a manifest is not to be edited)")


# ---------------------------------------------------------------------------- values


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} (text)" if isinstance(value, str) else text


_MISSING = object()  # a required field that is not there


def _fail(field: str, allowed: str, value: Any) -> Invalid:
    if value is _MISSING:
        return Invalid(f"{field} is missing: it must be {allowed}")
    return Invalid(f"{field} must be {allowed}, not {_shown(value)}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(field: str, value: Any, minimum: int = 0, meaning: str = "") -> int:
    """``value`` as a whole number ≥ ``minimum`` (an integral float too: fp16 scalers store floats), or `Invalid`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _whole(value) or value < minimum:
        raise _fail(field, f"a whole number ≥ {minimum}{f' ({meaning})' if meaning else ''}", value)
    return int(value)


def _number(field: str, value: Any, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise _fail(field, "a number > 0" if positive else "a number", value)


def _text(field: str, value: Any, choices: tuple[str, ...] = ()) -> None:
    if not isinstance(value, str) or not value or (choices and value not in choices):
        raise _fail(field, f"one of {', '.join(choices)}" if choices else "non-empty text", value)


def _sha(field: str, value: Any) -> None:
    if not isinstance(value, str) or not HEX64.match(value):
        raise _fail(field, "a sha256 (64 hex digits)", value)


def _mapping(field: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(field, "an object", value)
    return value


def _json(field: str, value: Any) -> None:
    """Plain JSON data (what the own loops keep in a manifest): no check beyond its shape."""
    if isinstance(value, dict):
        for key, item in _mapping(field, value).items():
            _json(f"{field}.{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _json(f"{field}[{i}]", item)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise _fail(field, "plain JSON data", value)


# ---------------------------------------------------------------------------- fields


def _files(field: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _fail(field, "an object naming each tensor file with its bytes and sha256", value)
    files = _mapping(field, value)
    for name, meta in files.items():
        if not FILE_NAME.match(name) or ".." in name:
            raise Invalid(f"{field} names {name!r}; a tensor file is named by a plain file name inside the checkpoint "
                          f"directory (like {MODEL_FILE}), never a path")
        meta = _mapping(f"{field}[{name!r}]", meta)
        count(f"{field}[{name!r}].bytes", meta.get("bytes"), 0, "the file's size")
        _sha(f"{field}[{name!r}].sha256", meta.get("sha256"))
    if MODEL_FILE not in files:
        raise Invalid(f"{field} does not list {MODEL_FILE} (every checkpoint holds the model)")


def _numbers(state: Any) -> bool:
    return isinstance(state, list) and all(_whole(v) and -2**63 <= v < 2**64 for v in state)


def _rng_states(field: str, value: Any, world_size: int) -> None:
    """One entry per rank: a list of whole numbers (a generator's state), or an object of them by generator
    (torch: ``cpu``, ``cuda``). What each framework's generator takes is its adapter's to check (`restore_rng`)."""
    if not isinstance(value, list) or len(value) not in (0, world_size):
        raise _fail(field, f"a list of one RNG state per rank (world_size {world_size})", value)
    for i, state in enumerate(value):
        if not (_numbers(state) or isinstance(state, dict) and state and all(map(_numbers, state.values()))):
            raise _fail(f"{field}[{i}]", "a rank's RNG state (a list of whole numbers, or an object of them by "
                                         "generator)", state)
        if isinstance(state, list) != isinstance(value[0], list) or isinstance(state, list) and \
                len(state) != len(value[0]) or isinstance(state, dict) and sorted(state) != sorted(value[0]):
            raise Invalid(f"{field}[{i}] is not of the form of {field}[0]; every rank's RNG state has the same form")


def _loss_scaler(field: str, value: Any) -> None:
    scaler = _mapping(field, value)
    if not scaler:
        return
    if sorted(scaler) != sorted(SCALER_KEYS):
        raise Invalid(f"{field} must be null or hold {', '.join(SCALER_KEYS)}, not {', '.join(sorted(scaler))}")
    for key in ("scale", "growth_factor", "backoff_factor"):
        _number(f"{field}.{key}", scaler[key], positive=True)
    count(f"{field}.growth_interval", scaler["growth_interval"], 1)
    count(f"{field}._growth_tracker", scaler["_growth_tracker"], 0)


def _early_stopping(field: str, value: Any) -> None:
    state = _mapping(field, value)
    if state.get("best") is not None:
        _number(f"{field}.best", state["best"])
    count(f"{field}.waited", state.get("waited", 0), 0, "validations without improvement")
    if not isinstance(state.get("stopped", False), bool):
        raise _fail(f"{field}.stopped", "true or false", state["stopped"])


def _dataset(field: str, value: Any) -> None:
    from polytrain.checkpoint.fingerprint import RecordError, check_record

    try:
        check_record(field, value)
    except RecordError as exc:
        raise Invalid(str(exc)) from None


def _strings(field: str, value: Any) -> None:
    for key, item in _mapping(field, value).items():
        _text(f"{field}.{key}", item)


def _groups(field: str, value: Any) -> None:
    if not isinstance(value, list):
        raise _fail(field, "a list of the optimizer's parameter groups", value)
    for i, group in enumerate(value):
        for key, item in _mapping(f"{field}[{i}]", group).items():
            if key in ("lr", "momentum", "weight_decay", "dampening", "eps") and not isinstance(item, (dict, type(None))):
                _number(f"{field}[{i}].{key}", item)  # (an object: a non-finite number in the own loops' form)
            _json(f"{field}[{i}].{key}", item)


Check = Callable[[str, Any], Any]


def _optional(check: Check) -> Check:
    return lambda field, value: None if value is None else check(field, value)


def _counts(minimum: int, meaning: str) -> Check:
    return lambda field, value: count(field, value, minimum, meaning)


#: the fields of a checkpoint's manifest that polytrain reads: name → (required, check)
CHECKPOINT_FIELDS: dict[str, tuple[bool, Check]] = {
    "files": (True, _files),
    "global_step": (True, _counts(0, "optimizer steps taken")),
    "epoch": (True, _counts(0, "epochs completed")),
    "step_in_epoch": (True, _counts(0, "steps taken in the epoch")),
    "world_size": (True, _counts(1, "how many ranks wrote it")),
    "samples_in_epoch": (False, _counts(0, "samples taken in the epoch")),
    "global_batch": (False, _counts(0, "samples a step")),
    "framework": (False, lambda f, v: _text(f, v, ("torch", "tensorflow"))),
    "backend": (False, _text),
    "origin": (False, _text),
    "run_id": (False, _optional(_text)),
    "model_digest": (False, _optional(_text)),
    "spec_digest": (False, _optional(_text)),
    "spec": (False, _optional(_mapping)),
    "trackers": (False, _optional(_strings)),
    "loss_scaler": (False, _optional(_loss_scaler)),
    "early_stopping": (False, _optional(_early_stopping)),
    "dataset": (False, _optional(_dataset)),
    "lr": (False, _optional(_number)),
    "loop_state": (False, _optional(lambda f, v: _json(f, _mapping(f, v)))),
    "loop_objects": (False, _optional(lambda f, v: _json(f, _mapping(f, v)))),
    "optimizer_groups": (False, _optional(_groups)),
}

#: the fields of a final ``model.json`` that polytrain reads (all optional: `polytrain.checkpoint.export` writes fewer)
MODEL_FIELDS: dict[str, tuple[bool, Check]] = {
    "safetensors_sha256": (False, lambda f, v: _sha(f, v)),
    "global_step": (False, _counts(0, "optimizer steps taken")),
    "epochs": (False, _counts(0, "epochs completed")),
    "world_size": (False, _counts(1, "how many ranks wrote it")),
    "framework": (False, lambda f, v: _text(f, v, ("torch", "tensorflow"))),
    "run_id": (False, _optional(_text)),
    "model_digest": (False, _optional(_text)),
    "spec": (False, _optional(_mapping)),
    "val_accuracy": (False, _optional(_number)),
    "val_loss": (False, _optional(_number)),
}


def _check_fields(manifest: Mapping[str, Any], fields: Mapping[str, tuple[bool, Check]], where: Path) -> None:
    try:
        for name, (required, check) in fields.items():
            if name in manifest or required:
                check(name, manifest.get(name, _MISSING))
        if "rng_states" in manifest and fields is CHECKPOINT_FIELDS:
            _rng_states("rng_states", manifest["rng_states"], manifest["world_size"])
    except Invalid as exc:
        raise CheckpointError(f"checkpoint: {where}: {exc}; the file is damaged or was edited") from None


def checked(manifest: Any, where: Path) -> dict[str, Any]:
    """A checkpoint's manifest (as parsed from ``where``, its manifest.json) after checking its format version,
    every field polytrain reads, and its digest; `CheckpointError` (one line naming the field and file) if not."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint: {where} is corrupt: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint: {where.parent} has format version {manifest.get('format_version')!r}; "
                              f"this polytrain reads version {FORMAT_VERSION}")
    _check_fields(manifest, CHECKPOINT_FIELDS, where)
    _check_digest(manifest, where)
    return manifest


def checked_model(manifest: Any, where: Path, hint: str) -> dict[str, Any]:
    """A final model's ``model.json`` (parsed from ``where``) after the same checks as a checkpoint's manifest."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint: {where} is corrupt: expected a JSON object, got "
                              f"{type(manifest).__name__}; {hint}")
    _check_fields(manifest, MODEL_FIELDS, where)
    _check_digest(manifest, where)
    return manifest


def member(path: Path, name: str) -> Path:
    """The file ``name`` of checkpoint ``path``, refused unless it is inside the directory once every symbolic
    link is followed."""
    file = path / name
    real, home = os.path.realpath(file), os.path.realpath(path)
    if os.path.dirname(real) != home:
        raise CheckpointError(f"checkpoint: {file} leads outside its checkpoint directory (to {real}); a checkpoint "
                              f"reads only its own files")
    return file


# ---------------------------------------------------------------------------- what a resume puts back


def restore_rng(set_state: Callable[[Any], None], manifest: Mapping[str, Any], path: Path, world: World) -> bool:
    """Put this rank's RNG state back (``set_state``, the framework's) when the checkpoint was written at this
    world size, one state per rank; the caller checks that it is the same framework's. True when put back; a
    state the framework refuses is one line naming the field and file."""
    states = manifest.get("rng_states") or []
    if manifest.get("world_size") != world.size or len(states) != world.size:
        return False
    try:
        set_state(states[world.rank])
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        detail = " ".join(str(exc).split())[:160]
        raise CheckpointError(f"checkpoint: {path / MANIFEST}: rng_states[{world.rank}] is not a {manifest.get('framework')} "
                              f"RNG state ({detail}); the file is damaged or was edited") from exc
    return True

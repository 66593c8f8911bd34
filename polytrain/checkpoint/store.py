"""Checkpoints: a directory per save, written atomically, loadable without unpickling.

Layout of ``<checkpoint.dir>``::

    step-00000120/            one complete checkpoint
        manifest.json         format, spec digest, framework, backend, world size, step, epoch, data
                              position, per-rank RNG states, files with sizes and hashes, its own sha256
        model.safetensors     portable names (no ``module.``/FSDP/ZeRO prefixes)
        optimizer.safetensors ``<param name>/<state key>`` → array
    latest                    the name of the newest complete checkpoint
    abandoned-after-step-00000040-<time>-<pid>/   step directories of a run that was rolled back

A save writes ``.tmp-step-…`` first, fsyncs every file, renames it into place, and only
then moves ``latest`` (itself replaced by rename). Older checkpoints beyond
``keep_last`` are removed after that. A process killed at any moment leaves the
previous checkpoint intact, and loading verifies sizes and hashes, so a partial one is
never taken; the manifest's fields and digest are checked first (`polytrain.checkpoint.manifest`).

Re-saving a step that exists (resuming a run that had finished) replaces its directory whole: a
crash at any moment leaves one complete checkpoint of that step (see `polytrain.checkpoint.files`).

Runs: every checkpoint names the run that wrote it (``run_id``; a resumed run goes on with the run id of the
checkpoint it resumed from, a fresh run has a new one). A save touches only its own run's checkpoints: it
refuses to replace a step directory of another run, and sets aside and prunes only its own run's (an
`Owner`). Checkpoints written before run ids existed have none; a run resumed from one of them takes those
of its model digest as its own. ``.tmp-`` directories are removed only when the process named in them has
ended.

Rollback: the newest save wins, whatever its step. A run resumed from an earlier step that saves
step S, where directories of higher steps exist, abandons those: once step S is durable (after
``latest`` names it), they are moved into one ``abandoned-after-step-<S>-<time>-<pid>/`` directory
under the root, which is never listed, pruned or resumed from (delete it, or move a checkpoint back
by hand). ``keep_last`` then counts back from S, so it never removes the checkpoint just written.
If a crash comes between moving ``latest`` and moving the abandoned steps aside, ``latest`` still
names S and `find_latest` prefers it (then lower steps, the abandoned higher ones last); the next
save moves them aside. Saves under ``best/`` (no ``keep_last``) are a ranked set, not a sequence,
and abandon nothing unless asked (``abandon_future``).

The final model (`write_model`): ``model.json`` records the sha256 of ``model.safetensors``, and a
crash leaves the old pair or the new one; `read_model` refuses a mismatched pair.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.checkpoint import files as cf
from polytrain.checkpoint import manifest as cm
from polytrain.checkpoint.manifest import FORMAT_VERSION, CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8,})$")
TMP_DIR = re.compile(r"^\.tmp-step-\d{8,}-(\d+)-\d+$")
RUN_KEY = "run_id"
_fsync_dir, _sha256, _write_file = cf.fsync_dir, cf.sha256, cf.write_file


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Owner:
    """The checkpoints a run may replace, set aside and prune: those of its run id, and — for a run resumed
    from a checkpoint written before run ids (``legacy_digest``, its model digest) — those without a run id
    of that model digest."""

    run_id: str | None
    legacy_digest: str | None = None

    def owns(self, manifest: Mapping[str, Any] | None) -> bool:
        if not isinstance(manifest, Mapping):
            return False
        theirs = manifest.get(RUN_KEY)
        if theirs is None and self.legacy_digest is not None:
            return manifest.get("model_digest") == self.legacy_digest
        return theirs == self.run_id


def read_manifest(path: Path) -> dict[str, Any] | None:
    """A checkpoint directory's manifest as it is (unverified), or None when missing or unreadable."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def run_of(path: Path) -> str:
    """Which run wrote a checkpoint, in words."""
    manifest = read_manifest(path)
    if manifest is None:
        return "an unreadable manifest"
    return f"run {manifest[RUN_KEY]}" if manifest.get(RUN_KEY) else "a run from before run ids"


def _contiguous(value: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape: a 0-d scalar (Adam's ``step``) stays 0-d, where
    ``np.ascontiguousarray`` would make it shape (1,) and no longer a scalar to the frameworks."""
    return np.ascontiguousarray(value) if np.ndim(value) else np.asarray(value)


def _tensor_bytes(state: Mapping[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({k: _contiguous(v) for k, v in state.items()})


def state_digest(state: Mapping[str, np.ndarray]) -> str:
    """A hash of names, dtypes, shapes and exact bytes: equal digests mean bit-identical states."""
    h = hashlib.sha256()
    for name in sorted(state):
        arr = np.ascontiguousarray(state[name])
        h.update(f"{name}|{arr.dtype}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------- final model


def write_model(path: Path, state: Mapping[str, np.ndarray], manifest: Mapping[str, Any]) -> None:
    """Write ``path/model.safetensors`` and ``path/model.json`` (which records the tensors' sha256 under
    ``safetensors_sha256``); a crash at any moment leaves the previous pair or the new one, never a mix."""
    data = _tensor_bytes(state)
    full = {**manifest, cf.DIGEST_KEY: hashlib.sha256(data).hexdigest()}
    cf.write_model_pair(path, data, cm.sealed_text(full, indent=2, sort_keys=True) + "\n")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_model(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read what `write_model` wrote (no unpickling), finishing a write a crash interrupted after its
    commit point. A ``model.json`` without ``safetensors_sha256`` (older polytrain) is read as it is; its fields
    and digest are checked (`polytrain.checkpoint.manifest`)."""
    from safetensors.numpy import load_file

    hint = "give a run's output directory with an intact model.safetensors and model.json, or a checkpoint"
    tensors, meta = path / cf.MODEL_FILE, path / cf.MODEL_JSON
    try:
        manifest = json.loads(meta.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {meta} is missing or corrupt ({_one_line(exc)}); {hint}") from exc
    digest = cm.checked_model(manifest, meta, hint).get(cf.DIGEST_KEY)
    try:
        source = cf.settle_model(path, digest) if isinstance(digest, str) else tensors
        state = load_file(str(source or tensors))
    except OSError as exc:
        raise CheckpointError(f"checkpoint: cannot read {tensors} ({exc.strerror or exc})") from exc
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"checkpoint: {tensors} is not a valid safetensors file "
                              f"({_one_line(exc)}); {hint}") from exc
    if source is None:
        raise CheckpointError(f"checkpoint: {tensors} does not belong with {meta} (its sha256 is not the "
                              f"{cf.DIGEST_KEY} that model.json records: a mixed or damaged pair); {hint}")
    return state, manifest


# ---------------------------------------------------------------------------- checkpoints


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def save_checkpoint(root: Path, step: int, tensors: Mapping[str, Mapping[str, np.ndarray]],
                    manifest: Mapping[str, Any], keep_last: int | None = None, *,
                    abandon_future: bool | None = None, owner: Owner | None = None) -> Path:
    """Write one checkpoint atomically under ``root`` (rank 0 only); returns its directory.

    ``tensors`` maps a file stem (``model``, ``optimizer``) to its name → array mapping. Step directories
    above ``step`` are moved aside once this one is durable (see the module's rollback rule) when
    ``abandon_future`` is true; by default, when ``keep_last`` is given (a run's sequence of saves).
    ``owner``: whose checkpoints this save may replace, set aside and prune (default: those of the
    manifest's run id); a step directory of another run is never replaced (`CheckpointError`).
    """
    owner = owner or Owner(manifest.get(RUN_KEY))
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    cf.recover_replaced(root)
    if final.exists() and not owner.owns(read_manifest(final)):
        raise CheckpointError(f"checkpoint.dir: {final} was written by {run_of(final)}, not this one; polytrain "
                              f"never replaces another run's checkpoint: choose another checkpoint.dir (or output)")
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{int(time.time() * 1e3)}"
    tmp.mkdir()
    try:
        files = {}
        for stem, state in tensors.items():
            path = tmp / f"{stem}.safetensors"
            _write_file(path, _tensor_bytes(state))
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        full_manifest = {"format_version": FORMAT_VERSION, **manifest, "global_step": step, "files": files}
        _write_file(tmp / "manifest.json", cm.sealed_text(full_manifest, indent=2, sort_keys=True).encode())
        _fsync_dir(tmp)
        cf.swap_in(tmp, final)  # a re-save of the same step (e.g. after a resume) replaces it whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".latest.tmp-{os.getpid()}"
    _write_file(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    if keep_last is not None if abandon_future is None else abandon_future:
        set_aside_future(root, step, owner)
    if keep_last is not None:
        prune(root, keep_last, owner)
    return final


def set_aside_future(root: Path, step: int, owner: Owner | None = None) -> Path | None:
    """Move every step directory above ``step`` (of ``owner``'s run; default: of no run id) into a new
    ``abandoned-after-step-…`` directory under ``root``; returns it (None when there was nothing to move)."""
    cf.recover_replaced(root)
    owner = owner or Owner(None)
    future = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name) and _step(p) > step and p.is_dir()
                    and owner.owns(read_manifest(p)))
    return move_aside(root, future, f"abandoned-after-{step_dir_name(step)}")


def move_aside(root: Path, paths: list[Path], prefix: str) -> Path | None:
    """Move ``paths`` (anywhere under ``root``) into a new ``<prefix>-<time>-<pid>/`` directory under ``root``
    at the same relative places, durably; returns it (None when ``paths`` is empty). Such a directory is never
    listed, pruned or resumed from."""
    if not paths:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    aside = root / f"{prefix}-{stamp}-{os.getpid()}"
    aside.mkdir()
    for path in paths:
        target = aside / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    for parent in sorted({(aside / p.relative_to(root)).parent for p in paths} | {p.parent for p in paths}):
        _fsync_dir(parent)
    return aside


def foreign_checkpoints(root: Path, owner: Owner) -> list[Path]:
    """The complete checkpoints under ``root`` that ``owner``'s run did not write, oldest first."""
    return [p for p in complete_checkpoints(root) if not owner.owns(read_manifest(p))]


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first (by step). Finishes first a directory
    replacement that a crash interrupted (`polytrain.checkpoint.files.recover_replaced`)."""
    if not root.is_dir():
        return []
    cf.recover_replaced(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()
             and (p / "manifest.json").is_file()]
    return [p for _, p in sorted(found)]


def _named_by_latest(root: Path, candidates: list[Path]) -> Path | None:
    """The checkpoint ``latest`` names, when it is among ``candidates``."""
    try:
        named = root / (root / "latest").read_text().strip()
    except (OSError, ValueError):
        return None
    return named if named in candidates else None


def _newest_first(root: Path, candidates: list[Path]) -> list[Path]:
    """``candidates`` (oldest first by step) from the newest save back: what ``latest`` names, then lower
    steps downwards, then any higher ones (the abandoned future of a rollback not yet set aside)."""
    named = _named_by_latest(root, candidates)
    if named is None:
        return list(reversed(candidates))
    lower = [p for p in candidates if _step(p) < _step(named)]
    higher = [p for p in candidates if _step(p) > _step(named)]
    return [named, *reversed(lower), *reversed(higher)]


def prune(root: Path, keep_last: int, owner: Owner | None = None) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints of ``owner``'s run (default: of no run id),
    and temporaries whose writer has ended. The newest are the one ``latest`` names and those below it: it is
    never removed, nor anything above it; nor is any checkpoint of another run."""
    owner = owner or Owner(None)
    candidates = complete_checkpoints(root)
    named = _named_by_latest(root, candidates)
    lineage = [p for p in candidates if (named is None or _step(p) <= _step(named)) and owner.owns(read_manifest(p))]
    for old in lineage[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-step-*"):
        m = TMP_DIR.match(tmp.name)
        if m and not cf.alive(int(m.group(1))):  # another writer's, still being written: left to it
            shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """Return the manifest of a checkpoint after checking its fields and digest (`polytrain.checkpoint.manifest`),
    and every file's place (inside ``path``), size and hash."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint: {path} has no manifest.json (not a polytrain checkpoint)") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {manifest_path} is unreadable or corrupt: {_one_line(exc)}") from exc
    for name, meta in cm.checked(manifest, manifest_path)["files"].items():
        file = cm.member(path, name)
        if not file.is_file() or file.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint: {file} is missing or truncated (expected {meta['bytes']} bytes)")
        # hashed once while unchanged (e.g. --resume auto chose it, then it is loaded)
        if not cf.matches(file, meta["sha256"], _sha256):
            raise CheckpointError(f"checkpoint: {file} is corrupt (sha256 does not match the manifest)")
    return manifest


def find_latest(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that verifies, or None when there is none."""
    for path in _newest_first(root, complete_checkpoints(root)):
        try:
            verify(path)
            return path
        except CheckpointError:
            continue
    return None


def resolve(resume: str, root: Path) -> Path | None:
    """``--resume auto`` → newest complete checkpoint in ``root`` (None if none); a path → that checkpoint."""
    if resume == "auto":
        found = find_latest(root)
        if found is None and (damaged := _newest_first(root, complete_checkpoints(root))):
            try:  # checkpoints are there, none verifies: say what is wrong with the newest, never start over
                verify(damaged[0])
            except CheckpointError as exc:
                raise CheckpointError(f"--resume auto: no checkpoint in {root} verifies; the newest: "
                                      f"{str(exc).removeprefix('checkpoint: ')}") from exc
        return found
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"--resume: {path} does not exist (give a checkpoint directory or 'auto')")
    if not path.is_dir():
        raise CheckpointError(f"--resume: {path} is a file; give a checkpoint directory (step-NNNNNNNN), the "
                              f"checkpoint root that holds them, or 'auto'")
    if not (path / "manifest.json").exists():  # a checkpoint root was given
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {path}; give a checkpoint directory "
                                  f"(step-NNNNNNNN) or the root that holds one, or 'auto' (starts from scratch "
                                  f"when checkpoint.dir holds none)")
        return latest
    try:  # checked here too so that the message names the flag and what to give instead
        verify(path)
    except CheckpointError as exc:
        detail = str(exc).removeprefix("checkpoint: ")
        raise CheckpointError(f"--resume: {detail}; give another checkpoint (an earlier step), or the "
                              f"checkpoint root to take the newest one that verifies") from exc
    return path


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """The verified manifest and every tensor file of a checkpoint (safetensors only: nothing is unpickled)."""
    from safetensors.numpy import load_file

    manifest = verify(path)
    tensors = {}
    for name in manifest["files"]:
        try:
            tensors[name.removesuffix(".safetensors")] = load_file(str(cm.member(path, name)))
        except Exception as exc:  # safetensors raises its own error types for malformed headers
            raise CheckpointError(f"checkpoint: {path / name} is not a valid safetensors file: "
                                  f"{_one_line(exc)}") from exc
    return manifest, tensors

"""Checkpoints: a directory per save, written atomically, loadable without unpickling.

Layout of ``<checkpoint.dir>``::

    step-00000120/            one complete checkpoint
        manifest.json         format, spec digest, framework, backend, world size, step, epoch,
                              data position, per-rank RNG states, files with sizes and hashes
        model.safetensors     portable names (no ``module.``/FSDP/ZeRO prefixes)
        optimizer.safetensors ``<param name>/<state key>`` → array
    latest                    the name of the newest complete checkpoint

A save writes ``.tmp-step-…`` first, fsyncs every file, renames it into place, and only
then moves ``latest`` (itself replaced by rename). Older checkpoints beyond
``keep_last`` are removed after that. A process killed at any moment leaves the
previous checkpoint intact, and loading verifies sizes and hashes, so a partial one is
never taken.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.errors import UserError

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, partial, corrupt, or from an incompatible spec."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    """Write ``path/model.safetensors`` and ``path/model.json``, each replaced atomically."""
    path.mkdir(parents=True, exist_ok=True)
    for name, data in (("model.safetensors", _tensor_bytes(state)),
                       ("model.json", (json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n").encode())):
        tmp = path / f".{name}.tmp-{os.getpid()}"
        _write_file(tmp, data)
        os.replace(tmp, path / name)
    _fsync_dir(path)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_model(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read what `write_model` wrote (no unpickling)."""
    from safetensors.numpy import load_file

    hint = "give a run's output directory with an intact model.safetensors and model.json, or a checkpoint"
    try:
        state = load_file(str(path / "model.safetensors"))
    except OSError as exc:
        raise CheckpointError(f"checkpoint: cannot read {path / 'model.safetensors'} ({exc.strerror or exc})") from exc
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"checkpoint: {path / 'model.safetensors'} is not a valid safetensors file "
                              f"({_one_line(exc)}); {hint}") from exc
    try:
        manifest = json.loads((path / "model.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {path / 'model.json'} is missing or corrupt ({_one_line(exc)}); "
                              f"{hint}") from exc
    return state, manifest


# ---------------------------------------------------------------------------- checkpoints


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(root: Path, step: int, tensors: Mapping[str, Mapping[str, np.ndarray]],
                    manifest: Mapping[str, Any], keep_last: int | None = None) -> Path:
    """Write one checkpoint atomically under ``root`` (rank 0 only); returns its directory.

    ``tensors`` maps a file stem (``model``, ``optimizer``) to its name → array mapping.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{int(time.time() * 1e3)}"
    tmp.mkdir()
    try:
        files = {}
        for stem, state in tensors.items():
            path = tmp / f"{stem}.safetensors"
            _write_file(path, _tensor_bytes(state))
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        full_manifest = {"format_version": FORMAT_VERSION, **manifest, "global_step": step, "files": files}
        _write_file(tmp / "manifest.json", json.dumps(full_manifest, indent=2, sort_keys=True, default=str).encode())
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".latest.tmp-{os.getpid()}"
    _write_file(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first (by step)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()
             and (p / "manifest.json").is_file()]
    return [p for _, p in sorted(found)]


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints, and stale temporaries."""
    for old in complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-step-*"):
        if str(os.getpid()) not in tmp.name:
            shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """Return the manifest of a checkpoint after checking every file's size and hash."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint: {path} has no manifest.json (not a polytrain checkpoint)") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {manifest_path} is unreadable or corrupt: {_one_line(exc)}") from exc
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint: {manifest_path} is corrupt: expected a JSON object, "
                              f"got {type(manifest).__name__}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint: {path} has format version {manifest.get('format_version')!r}; "
                              f"this polytrain reads version {FORMAT_VERSION}")
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
            for meta in files.values()):
        raise CheckpointError(f"checkpoint: {manifest_path} is corrupt: 'files' must map each file name to its "
                              f"bytes and sha256")
    for name, meta in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint: {file} is missing or truncated (expected {meta['bytes']} bytes)")
        key, seen = file.resolve(), (_file_identity(file), meta["sha256"])
        if _HASHED.get(key) == seen:
            continue  # hashed a moment ago (e.g. --resume auto chose it, then it is loaded), unchanged since
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"checkpoint: {file} is corrupt (sha256 does not match the manifest)")
        _HASHED[key] = seen
    return manifest


#: file → (identity when it last matched its manifest's hash, that hash): one read of a large file per process
_HASHED: dict[Path, tuple[tuple[int, int, int, int], str]] = {}


def _file_identity(file: Path) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: inode, size, modification and change times."""
    st = file.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def find_latest(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that verifies, or None when there is none."""
    candidates = complete_checkpoints(root)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in candidates:  # prefer what `latest` names, then anything newer or older that verifies
            candidates.remove(named)
            candidates.append(named)
    for path in reversed(candidates):
        try:
            verify(path)
            return path
        except CheckpointError:
            continue
    return None


def resolve(resume: str, root: Path) -> Path | None:
    """``--resume auto`` → newest complete checkpoint in ``root`` (None if none); a path → that checkpoint."""
    if resume == "auto":
        return find_latest(root)
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
    for name in manifest.get("files", {}):
        try:
            tensors[name.removesuffix(".safetensors")] = load_file(str(path / name))
        except Exception as exc:  # safetensors raises its own error types for malformed headers
            raise CheckpointError(f"checkpoint: {path / name} is not a valid safetensors file: "
                                  f"{_one_line(exc)}") from exc
    return manifest, tensors

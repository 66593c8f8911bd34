"""Saving model state: safetensors tensors + a JSON manifest, written atomically.

A directory is written under a temporary name and renamed into place, so a crash
never leaves a half-written result under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model(path: Path, state: Mapping[str, np.ndarray], manifest: Mapping[str, Any]) -> None:
    """Write ``path/model.safetensors`` and ``path/model.json`` (replacing an older pair atomically)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=path))
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "model.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        for name in ("model.safetensors", "model.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp / name, path / name)
        _fsync_dir(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_model(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read what `write_model` wrote (no unpickling)."""
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors")), json.loads((path / "model.json").read_text())


def state_digest(state: Mapping[str, np.ndarray]) -> str:
    """A hash of names, dtypes, shapes and exact bytes: equal digests mean bit-identical states."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        arr = np.ascontiguousarray(state[name])
        h.update(f"{name}|{arr.dtype}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()[:32]

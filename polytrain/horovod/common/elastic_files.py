"""Framework-neutral pieces of ``hvd.elastic`` commits, on numpy: no pickle, a private directory.

A commit (a *snapshot*: numbers, strings, None, numpy arrays and lists/tuples/dicts of them) is
encoded as one safetensors blob — arrays as tensors, the rest as JSON in the blob's metadata,
arrays named there by key (`encode_state` / `decode_state`). Decoding never runs code, whoever
made the bytes. The same bytes serve two purposes: the file a restarted job reads back
(`write_state` / `read_state`, ``state.safetensors``) and the message that brings every rank to
rank 0's plain values on ``state.sync()`` (so that needs no pickle either).

The file lives in a private directory: ``$POLYTRAIN_HOROVOD_ELASTIC_DIR``, or
``<tmp>/polytrain-elastic-<uid>-<job key>``. The directory is made with mode 0700; one that
already exists is used only if it is a real directory (not a link), owned by this user, with no
group or other permissions — another local user could have planted anything else.

The layout (format tag, skeleton keys, file name, directory rule) is the one of
``polytrain.horovod.torch.elastic_store``, so either framework's files read in the other.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from polytrain.errors import UserError

STATE_DIR_VARIABLE = "POLYTRAIN_HOROVOD_ELASTIC_DIR"
STATE_FILE = "state.safetensors"
FORMAT = "polytrain.elastic/1"


class ElasticStateError(UserError):
    """The commit directory is not private to this user, or the commit file is not one of ours."""


def state_dir(env: dict[str, str] | None = None) -> Path:
    """Where commits persist: ``$POLYTRAIN_HOROVOD_ELASTIC_DIR`` or a per-user, per-job directory in tmp."""
    env = dict(os.environ) if env is None else env
    if env.get(STATE_DIR_VARIABLE):
        return Path(env[STATE_DIR_VARIABLE])
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    key = "-".join(v for v in (run_id, env.get("MASTER_PORT", "")) if v and v != "none") or "default"
    return Path(tempfile.gettempdir()) / f"polytrain-elastic-{os.getuid()}-{key}"


def private_dir(path: Path, create: bool = True) -> Path | None:
    """``path`` made (mode 0700) or checked private to this user; None if absent and not ``create``."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o} (open to group/others)"
    if problem:
        raise ElasticStateError(
            f"{STATE_DIR_VARIABLE}: {path} {problem}; hvd.elastic keeps its commits only in a directory owned by "
            f"this user with mode 0700 (remove it, or set {STATE_DIR_VARIABLE} to such a directory)")
    return path


def encode_state(snapshot: Any) -> bytes:
    """``snapshot`` as safetensors bytes (a TypeError naming the value that cannot be kept)."""
    arrays: dict[str, np.ndarray] = {}
    skeleton = _encode(snapshot, arrays, "state")
    return safetensors.numpy.save(arrays, metadata={"format": FORMAT, "state": json.dumps(skeleton)})


def decode_state(data: bytes) -> Any:
    """The snapshot `encode_state` made; ValueError (or another plain error) for bytes that are not one."""
    arrays = safetensors.numpy.load(data)
    return _decode(skeleton_of(data), arrays)


def skeleton_of(data: bytes) -> Any:
    """The JSON skeleton in a commit's safetensors metadata, after checking its format tag."""
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
    return json.loads(metadata["state"])


def write_state(directory: Path, snapshot: Any) -> Path:
    """Save ``snapshot`` atomically as ``directory/state.safetensors``; the directory is made private."""
    return write_commit(directory, encode_state(snapshot))  # encoded first: an unsavable value leaves no file


def read_state(directory: Path) -> Any | None:
    """The snapshot saved in ``directory`` (checked private first), or None if there is none."""
    return read_commit(directory, decode_state)


def write_commit(directory: Path, data: bytes) -> Path:
    """The bytes of an encoded commit, written atomically as ``directory/state.safetensors`` (made private)."""
    private_dir(directory)
    fd, partial = tempfile.mkstemp(prefix="state.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, directory / STATE_FILE)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return directory / STATE_FILE


def read_commit(directory: Path, decode: Callable[[bytes], Any]) -> Any | None:
    """``decode`` of the commit file's bytes (the directory checked private first, the file opened without
    following a link), or None if there is none; anything that fails to decode is an `ElasticStateError`."""
    if private_dir(directory, create=False) is None:
        return None
    path = directory / STATE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise ElasticStateError(f"{STATE_DIR_VARIABLE}: {path} cannot be opened as a plain file ({exc})") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        return decode(data)
    except Exception as exc:  # safetensors, struct, json and a skeleton naming missing arrays all raise
        raise ElasticStateError(f"{STATE_DIR_VARIABLE}: {path} is not an hvd.elastic commit "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


_SCALARS = (bool, int, float, str, type(None))


def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    """``value`` as JSON; arrays go into ``arrays`` and are named by key."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.array(value, copy=True, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
        if array.dtype.kind not in "biuf":
            raise TypeError(f"hvd.elastic: cannot keep {where}: a numpy {array.dtype} value has no tensor dtype")
        key = f"t{len(arrays)}"
        arrays[key] = array
        return {"$ndarray" if isinstance(value, np.ndarray) else "$npscalar": key}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict):
        return {"$dict": [[_encode(k, arrays, f"{where} key {k!r}"), _encode(v, arrays, f"{where}[{k!r}]")]
                          for k, v in value.items()]}
    raise TypeError(f"hvd.elastic: cannot keep {where} (a {type(value).__name__}) without pickle; keep only "
                    f"numpy arrays, numbers, strings, None and lists/tuples/dicts of them in the state")


def _decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    for tag in ("$ndarray", "$tensor"):  # a torch commit's tensors come back as arrays
        if tag in value:
            return arrays[value[tag]]
    if "$npscalar" in value:
        return arrays[value["$npscalar"]][()]
    if "$tuple" in value:
        return tuple(_decode(v, arrays) for v in value["$tuple"])
    return {_decode(k, arrays): _decode(v, arrays) for k, v in value["$dict"]}


__all__ = ["ElasticStateError", "FORMAT", "STATE_DIR_VARIABLE", "STATE_FILE", "decode_state", "encode_state",
           "private_dir", "read_state", "state_dir", "write_state"]

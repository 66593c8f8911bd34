"""``hvd.elastic`` commits for both frameworks: one encoder, one decoder, no pickle, a private directory.

A commit (a *snapshot*: numbers, strings, None, numpy arrays, a framework's tensors and
lists/tuples/dicts of them) is encoded as one safetensors blob — arrays and tensors as tensors, the
rest as JSON in the blob's metadata, tensors named there by key (`encode_state` / `decode_state`).
Decoding never runs code, whoever made the bytes. The same bytes serve two purposes: the file a
restarted job reads back (`write_state` / `read_state`, ``state.safetensors``) and the message that
brings every rank to rank 0's plain values on ``state.sync()`` (so that needs no pickle either).

The walk over the snapshot is written once, here; what differs between frameworks is only how
their tensors are stored (`Tensors`: numpy arrays by default, torch tensors in
``polytrain.horovod.torch.elastic``), so either framework's commits read in the other (a torch
tensor comes back as a numpy array, unless its dtype has none, e.g. bfloat16).

The file lives in a private directory: ``$POLYTRAIN_HOROVOD_ELASTIC_DIR``, or
``<tmp>/polytrain-elastic-<uid>-<job key>``. The directory is made with mode 0700; one that
already exists is used only if it is a real directory (not a link), owned by this user, with no
group or other permissions — another local user could have planted anything else.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from collections import OrderedDict
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


class Tensors:
    """How a framework's commit stores its tensors: numpy arrays here (TensorFlow's states hold numpy copies of
    their variables); torch's subclass stores torch tensors. A snapshot's own tensors are tagged ``$tensor``
    in the skeleton, numpy values ``$ndarray`` / ``$npscalar``."""

    #: what a snapshot may hold besides plain values, for the message refusing anything else
    kinds = "numpy arrays"

    def own(self, value: Any, where: str) -> tuple[Any, dict[str, Any]] | None:
        """``value`` stored, and what its skeleton entry records besides its key, if it is this framework's tensor."""
        return None

    def from_numpy(self, array: np.ndarray, where: str) -> Any:
        """A (C-ordered copy of a) numpy value as stored."""
        if array.dtype.kind not in "biuf":
            raise TypeError(f"hvd.elastic: cannot persist {where}: a numpy {array.dtype} value has no tensor dtype")
        return array

    def to_numpy(self, stored: Any) -> np.ndarray:
        return stored

    def tensor(self, stored: Any, entry: dict[str, Any]) -> Any:
        """The value of a ``$tensor`` entry (another framework's tensor: the array)."""
        return stored

    def save(self, stored: dict[str, Any], metadata: dict[str, str]) -> bytes:
        return safetensors.numpy.save(stored, metadata=metadata)

    def load(self, data: bytes) -> dict[str, Any]:
        return safetensors.numpy.load(data)


NUMPY = Tensors()


def encode_state(snapshot: Any, tensors: Tensors = NUMPY) -> bytes:
    """``snapshot`` as safetensors bytes (a TypeError naming the value that cannot be kept)."""
    stored: dict[str, Any] = {}
    skeleton = _encode(snapshot, tensors, stored, "state")
    return tensors.save(stored, {"format": FORMAT, "state": json.dumps(skeleton)})


def decode_state(data: bytes, tensors: Tensors = NUMPY) -> Any:
    """The snapshot `encode_state` made; ValueError (or another plain error) for bytes that are not one."""
    stored = tensors.load(data)
    return _decode(skeleton_of(data), tensors, stored)


def skeleton_of(data: bytes) -> Any:
    """The JSON skeleton in a commit's safetensors metadata, after checking its format tag."""
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
    return json.loads(metadata["state"])


def write_state(directory: Path, snapshot: Any, tensors: Tensors = NUMPY) -> Path:
    """Save ``snapshot`` atomically as ``directory/state.safetensors``; the directory is made private."""
    return write_commit(directory, encode_state(snapshot, tensors))  # encoded first: an unsavable value leaves no file


def read_state(directory: Path, tensors: Tensors = NUMPY) -> Any | None:
    """The snapshot saved in ``directory`` (checked private first), or None if there is none."""
    return read_commit(directory, lambda data: decode_state(data, tensors))


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


def _encode(value: Any, tensors: Tensors, stored: dict[str, Any], where: str) -> Any:
    """``value`` as JSON; tensors and arrays go into ``stored`` and are named by key."""
    if isinstance(value, _SCALARS):
        return value
    own = tensors.own(value, where)
    if own is not None:
        key = f"t{len(stored)}"
        stored[key], entry = own
        return {"$tensor": key, **entry}
    if isinstance(value, (np.ndarray, np.generic)):
        key = f"t{len(stored)}"  # np.array, not ascontiguousarray: that makes a 0-d array 1-d
        stored[key] = tensors.from_numpy(np.array(value, copy=True, order="C"), where)
        return {"$ndarray" if isinstance(value, np.ndarray) else "$npscalar": key}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, stored, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict):
        out: dict[str, Any] = {"$dict": [[_encode(k, tensors, stored, f"{where} key {k!r}"),
                                          _encode(v, tensors, stored, f"{where}[{k!r}]")] for k, v in value.items()]}
        metadata = getattr(value, "_metadata", None)  # module versions, kept by a torch state_dict's OrderedDict
        if isinstance(value, OrderedDict) and isinstance(metadata, dict):
            out["$metadata"] = _encode(metadata, tensors, stored, f"{where} metadata")
        return out
    raise TypeError(f"hvd.elastic: cannot persist {where} (a {type(value).__name__}) without pickle; commit only "
                    f"{tensors.kinds}, numbers, strings, None and lists/tuples/dicts of them")


def _decode(value: Any, tensors: Tensors, stored: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, stored) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors.tensor(stored[value["$tensor"]], value)
    if "$ndarray" in value:
        return tensors.to_numpy(stored[value["$ndarray"]])
    if "$npscalar" in value:
        return tensors.to_numpy(stored[value["$npscalar"]])[()]
    if "$tuple" in value:
        return tuple(_decode(v, tensors, stored) for v in value["$tuple"])
    pairs = [(_decode(k, tensors, stored), _decode(v, tensors, stored)) for k, v in value["$dict"]]
    if "$metadata" not in value:
        return dict(pairs)
    out = OrderedDict(pairs)
    out._metadata = _decode(value["$metadata"], tensors, stored)  # type: ignore[attr-defined]
    return out


__all__ = ["FORMAT", "NUMPY", "STATE_DIR_VARIABLE", "STATE_FILE", "ElasticStateError", "Tensors", "decode_state",
           "encode_state", "private_dir", "read_state", "state_dir", "write_state"]

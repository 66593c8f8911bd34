"""Where and how ``hvd.elastic`` keeps its commits across job restarts, with no pickle.

A commit is one safetensors file, ``state.safetensors``: tensors as tensors, and the rest of the
state (numbers, strings, None, lists, tuples, dicts) as JSON in the file's metadata, tensors named
there by key. Reading it never runs code, whoever wrote it.

The file lives in a private directory: ``$POLYTRAIN_HOROVOD_ELASTIC_DIR``, or
``<tmp>/polytrain-elastic-<uid>-<job key>`` (a restarted job must find it again, so its name is
fixed by the job). The directory is made with mode 0700; one that already exists is used only if
it is a real directory (not a link), owned by this user, with no group or other permissions —
anything else is refused, as another local user could have planted it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from polytrain.horovod.common.elastic_files import (  # the directory rule and file layout both frameworks share
    FORMAT,
    STATE_DIR_VARIABLE,
    STATE_FILE,
    ElasticStateError,
    private_dir,
    read_commit,
    skeleton_of,
    state_dir,
    write_commit,
)

__all__ = ["FORMAT", "STATE_DIR_VARIABLE", "STATE_FILE", "ElasticStateError", "private_dir", "read_state", "state_dir",
           "write_state"]


def write_state(directory: Path, snapshot: Any) -> Path:
    """Save ``snapshot`` atomically as ``directory/state.safetensors``; the directory is made private."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(snapshot, tensors, "state")  # before any file exists: an unsavable value leaves none
    return write_commit(directory, safetensors.torch.save(tensors, metadata={"format": FORMAT,
                                                                             "state": json.dumps(skeleton)}))


def _decode_commit(data: bytes) -> Any:
    tensors = safetensors.torch.load(data)
    return _decode(skeleton_of(data), tensors)


def read_state(directory: Path) -> Any | None:
    """The snapshot saved in ``directory`` (checked private first), or None if there is none."""
    return read_commit(directory, _decode_commit)


_SCALARS = (bool, int, float, str, type(None))


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """``value`` as JSON; tensors and arrays go into ``tensors`` and are named by key."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"hvd.elastic: cannot persist {where}: a {value.layout} tensor (only dense tensors)")
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"$tensor": key, "device": str(value.device)}
    if isinstance(value, (np.ndarray, np.generic)):
        key = f"t{len(tensors)}"
        try:
            tensors[key] = torch.from_numpy(np.array(value, copy=True).reshape(np.shape(value)))
        except TypeError:  # object, string and other dtypes torch has no tensor for
            raise TypeError(f"hvd.elastic: cannot persist {where}: a numpy {value.dtype} value has no tensor "
                            f"dtype") from None
        return {"$ndarray" if isinstance(value, np.ndarray) else "$npscalar": key}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict):
        out: dict[str, Any] = {"$dict": [[_encode(k, tensors, f"{where} key {k!r}"),
                                          _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
        metadata = getattr(value, "_metadata", None)  # module versions, kept by a state_dict's OrderedDict
        if isinstance(value, OrderedDict) and isinstance(metadata, dict):
            out["$metadata"] = _encode(metadata, tensors, f"{where} metadata")
        return out
    raise TypeError(f"hvd.elastic: cannot persist {where} (a {type(value).__name__}) across restarts without pickle; "
                    f"commit only tensors, numpy arrays, numbers, strings, None and lists/tuples/dicts of them")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        tensor = tensors[value["$tensor"]]
        return tensor if value["device"] == "cpu" else tensor.to(value["device"])
    if "$ndarray" in value:
        return tensors[value["$ndarray"]].numpy()
    if "$npscalar" in value:
        return tensors[value["$npscalar"]].numpy()[()]
    if "$tuple" in value:
        return tuple(_decode(v, tensors) for v in value["$tuple"])
    pairs = [(_decode(k, tensors), _decode(v, tensors)) for k, v in value["$dict"]]
    if "$metadata" not in value:
        return dict(pairs)
    out = OrderedDict(pairs)
    out._metadata = _decode(value["$metadata"], tensors)  # type: ignore[attr-defined]
    return out


__all__ = ["ElasticStateError", "STATE_DIR_VARIABLE", "private_dir", "read_state", "state_dir", "write_state"]

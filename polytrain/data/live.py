"""Data handed to `polytrain.fit` as live objects: ``(x, y)`` numpy arrays or a map-style dataset."""

from __future__ import annotations

from typing import Any

import numpy as np

from polytrain.data.files import check_inferred, finite_or_refuse
from polytrain.data.source import ArraySource, Data, DatasetInfo, Source, split
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec


def _arrays(value: Any, where: str) -> tuple[np.ndarray, np.ndarray] | None:
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, np.ndarray) for v in value):
        x, y = value
        if len(x) != len(y) or len(x) == 0:
            raise SpecError(f"{where}: x and y must have the same, non-zero length (x: {len(x)}, y: {len(y)})")
        return x, y
    return None


def _array_source(x: np.ndarray, y: np.ndarray, classes: int | None, where: str) -> tuple[Source, DatasetInfo]:
    """Arrays as the built-in ``npz`` data reads them: float32 x (images N×C×H×W flattened), int64 class labels
    or float32 regression targets, int64 token sequences for next-token data."""
    if np.issubdtype(y.dtype, np.integer) and np.issubdtype(x.dtype, np.integer) and x.shape == y.shape \
            and x.ndim == 2:
        if classes is None:
            check_inferred(int(max(x.max(), y.max())), f"{where}: x or y", what="token id")
        vocab = classes or int(max(x.max(), y.max())) + 1
        info = DatasetInfo(input_shape=(x.shape[1],), num_outputs=vocab, task="next_token")
        return ArraySource(x.astype(np.int64), y.astype(np.int64)), info
    image_shape = tuple(int(d) for d in x.shape[1:]) if x.ndim == 4 else None
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32: Inf, refused below
        x = x.reshape(len(x), -1).astype(np.float32) if x.ndim == 4 else x.astype(np.float32)
    finite_or_refuse(x, f"{where}: x")
    if np.issubdtype(y.dtype, np.integer):
        if y.min() < 0 or (classes is not None and y.max() >= classes):
            allowed = f"0..{classes - 1} (data.classes {classes})" if classes is not None else "0 or more"
            raise SpecError(f"{where}: class labels must be {allowed}, found {int(y.min())}..{int(y.max())}")
        if classes is None:
            check_inferred(int(y.max()), f"{where}: y")
        info = DatasetInfo(input_shape=tuple(x.shape[1:]), num_outputs=classes or int(y.max()) + 1,
                           task="classification", image_shape=image_shape)  # type: ignore[arg-type]
        return ArraySource(x, y.astype(np.int64)), info
    info = DatasetInfo(input_shape=tuple(x.shape[1:]), num_outputs=1, task="regression",
                       image_shape=image_shape)  # type: ignore[arg-type]
    with np.errstate(over="ignore", invalid="ignore"):
        y = y.astype(np.float32)
    finite_or_refuse(y, f"{where}: y")
    return ArraySource(x, y), info


def _source(value: Any, spec: DataSpec, where: str) -> tuple[Source, DatasetInfo]:
    arrays = _arrays(value, where)
    if arrays is not None:
        return _array_source(*arrays, spec.classes, where)
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        from polytrain.data.user import dataset_source

        return dataset_source(value, where, spec)
    raise SpecError(f"{where}: expected (x, y) numpy arrays or a map-style dataset (__len__, __getitem__), got a "
                    f"{type(value).__name__}")


def data_from_objects(train: Any, val: Any | None, spec: DataSpec, seed: int) -> Data:
    """`Data` from live objects; without ``val`` the training data is split by ``data.val_fraction``."""
    train_source, info = _source(train, spec, "train_data")
    if val is None:
        train_source, val_source = split(train_source, spec.val_fraction, seed)
    else:
        val_source, val_info = _source(val, spec, "val_data")
        if (val_info.input_shape, val_info.task) != (info.input_shape, info.task):
            raise SpecError(f"val_data: samples of shape {val_info.input_shape} ({val_info.task}) do not match "
                            f"train_data's {info.input_shape} ({info.task})")
    return Data(train_source, val_source, info)

"""Opening the built-in in-memory datasets as sources (the rows of `polytrain.registry.SOURCES` that
name ``open_arrays``); file-backed sources have a module each beside this one."""

from __future__ import annotations

from polytrain.data.arrays import load_dataset
from polytrain.data.source import ArraySource, Data
from polytrain.spec.tables import DataSpec


def open_arrays(spec: DataSpec, seed: int) -> Data:
    """``digits``, ``synthetic``, ``npz`` or ``tokens``: loaded into memory and split by ``seed``, as before."""
    data = load_dataset(spec, seed)
    return Data(ArraySource(data.x_train, data.y_train), ArraySource(data.x_val, data.y_val), data.info)

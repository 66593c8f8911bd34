"""What the file-backed sources share: finding the files a ``data.path`` names, labels and their task,
a small thread-safe cache of decoded blocks, reading byte ranges without a file position, and putting
train and validation together into `Data`.

Every problem is a `SpecError` naming the field and the file, one line.
"""

from __future__ import annotations

import glob
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from polytrain.data.source import Data, DatasetInfo, Source, Subset, split
from polytrain.errors import SpecError

T = TypeVar("T")


def expand(path: str, field: str, suffixes: Sequence[str]) -> list[Path]:
    """The files ``path`` names: a file, every file ending in one of ``suffixes`` under a directory
    (recursively), or a glob; sorted, so every rank sees them in the same order."""
    if not path:
        raise SpecError(f"data.{field}: empty")
    if glob.has_magic(path):
        found = [Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file()]
    elif Path(path).is_dir():
        found = [p for p in Path(path).rglob("*") if p.is_file() and p.name.lower().endswith(tuple(suffixes))]
    elif Path(path).is_file():
        found = [Path(path)]
    else:
        raise SpecError(f"data.{field}: file not found: {path}")
    if not found:
        raise SpecError(f"data.{field}: no {'/'.join('*' + s for s in suffixes)} files match {path}")
    return sorted(found)


def check_apart(train: Sequence[Path], val: Sequence[Path]) -> None:
    """No file is both: ``data.val_path`` inside a ``data.path`` read recursively (or a glob matching both)
    would put validation samples into training. Refused rather than dropped from training, so the files a
    run trains on are always the ones ``data.path`` names."""
    seen = {os.path.realpath(p) for p in train}
    shared = [p for p in val if os.path.realpath(p) in seen]
    if shared:
        raise SpecError(f"data.val_path: {len(shared)}/{len(val)} validation files are also read by data.path "
                        f"(first: {shared[0]}); give data.path without them (a directory or glob that leaves the "
                        "validation files out)")


def nested(a: Path, b: Path) -> bool:
    """Whether one of two directories is (inside) the other."""
    a, b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return a == b or a in b.parents or b in a.parents


def label_task(kind: str, where: str) -> str:
    """``classification`` for integer (or boolean) labels, ``regression`` for floats (numpy dtype ``kind``)."""
    if kind in "iub":
        return "classification"
    if kind == "f":
        return "regression"
    raise SpecError(f"data.label: {where} holds {kind!r}-kind values; labels must be integers (classes) or floats")


#: the most classes (or token ids) a source infers from its largest label: a stray label of 2**40 would
#: otherwise make a model with 10**12 outputs. More are taken when data.classes (data.vocab) says so.
MAX_INFERRED_CLASSES = 1 << 20


def check_label_range(low: int, high: int, classes: int | None, where: str, field: str = "data.label") -> None:
    """Class labels are ``0 .. classes-1``: a negative one, one ≥ ``data.classes``, or without it one ≥
    `MAX_INFERRED_CLASSES`, is an error naming ``field`` and ``where``."""
    if low < 0:
        raise SpecError(f"{field}: {where} has label {low}; class labels must be 0 or more")
    if classes is not None and high >= classes:
        raise SpecError(f"{field}: {where} has label {high}, not below data.classes {classes}")
    if classes is None:
        check_inferred(high, f"{field}: {where}")


def check_inferred(high: int, where: str, setting: str = "data.classes", what: str = "label") -> None:
    """Without ``setting``, the largest label (token id) must be below `MAX_INFERRED_CLASSES`; ``where``
    starts the message (``data.label: <file>``)."""
    if high >= MAX_INFERRED_CLASSES:
        raise SpecError(f"{where} has {what} {high}; without {setting} {what}s must be below "
                        f"{MAX_INFERRED_CLASSES} (set {setting} if the model really needs {high + 1} outputs)")


def finite_or_refuse(values: np.ndarray, where: str) -> None:
    """An in-memory array (``where``: ``train_data: x``, a file ...) holding NaN or ±Inf is an error."""
    bad = first_nonfinite(values)
    if bad is not None:
        raise SpecError(f"{where} holds NaN or Inf (or a value float32 cannot hold) at sample {bad}; values must be "
                        "finite numbers")


def first_nonfinite(values: np.ndarray) -> int | None:
    """The first row of ``values`` holding NaN or ±Inf (float arrays; None when there is none)."""
    if values.dtype.kind not in "fc" or np.isfinite(values).all():
        return None
    flat = np.isfinite(values).reshape(len(values), -1).all(axis=1)
    return int(np.argmin(flat))


def num_outputs(task: str, classes: int | None, high: int) -> int:
    """``data.classes``, else the largest label + 1 (at least 2) for classification; 1 for regression."""
    if task != "classification":
        if classes is not None:
            raise SpecError("data.classes: given, but the labels are floats (regression)")
        return 1
    return classes if classes is not None else max(int(high) + 1, 2)


def as_label(y: np.ndarray, task: str) -> np.ndarray:
    return y.astype(np.int64, copy=False) if task == "classification" else y.astype(np.float32, copy=False)


class BlockCache(Generic[T]):
    """At most ``capacity`` decoded blocks (row groups), least recently used out first; thread-safe.

    Two threads asking for the same missing block wait for one decode instead of doing it twice.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self._loading: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self.decodes = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}  # a copy in another process starts empty

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])  # type: ignore[misc]

    def get(self, key: Hashable, load: Callable[[], T]) -> T:
        while True:
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    return self._items[key]
                waiting = self._loading.get(key)
                if waiting is None:
                    self._loading[key] = threading.Event()
                    break
            waiting.wait()
        try:
            value = load()
            with self._lock:
                self.decodes += 1
                self._items[key] = value
                while len(self._items) > self.capacity:
                    self._items.popitem(last=False)
            return value
        finally:
            with self._lock:
                self._loading.pop(key).set()


class RawFile:
    """Byte ranges of one file read with ``os.pread``: no shared file position (safe from any thread), and
    nothing stays mapped into the process (an ``np.memmap``'s touched pages count in its resident memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _descriptor(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._descriptor(), size, offset)
        if len(data) != size:
            raise SpecError(f"data.path: {self.path} is shorter than when it was opened (changed while training?)")
        return data

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def pair(train: Source, val: Source | None, val_fraction: float, seed: int) -> tuple[Source, Source]:
    """(train, validation): the files ``data.val_path`` names when given (``val``), else a seeded
    ``val_fraction`` split of the training files."""
    if val is not None:
        return train, val
    if val_fraction == 0:
        return train, Subset(train, np.zeros(0, dtype=np.int64))
    return split(train, val_fraction, seed)


def assemble(train: Source, val: Source, info: DatasetInfo, guarantee: str, **extra: Any) -> Data:
    if len(train) == 0:
        raise SpecError("data.path: no training samples")
    return Data(train=train, val=val, info=info, guarantee=guarantee, **extra)

"""``data.name: csv`` — small tabular data in comma-separated files with a header row naming the columns.

Opening reads each file once, line by line, keeping only where each row starts (8 bytes a row) and the
label column's range; a batch reads its rows back by offset (``os.pread``) and parses them with the
``csv`` module. Quoted fields may hold commas, doubled quotes and line breaks (a row then spans lines; the
scan keeps a row open while it has an odd number of quote characters). Map-style: the
epoch's order is a full shuffle of the rows.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from polytrain.data.files import RawFile, assemble, check_label_range, expand, num_outputs, pair
from polytrain.data.plan import shuffled
from polytrain.data.source import Data
from polytrain.errors import SpecError
from polytrain.protocols import DatasetInfo
from polytrain.spec import DataSpec

_SCAN_LINES = 65536  # labels parsed this many lines at a time while scanning


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


class CsvFile:
    """One file: its header, every row's byte offset and length, and its label column's kind and range."""

    def __init__(self, path: Path, field: str, columns: tuple[str, ...], label: str) -> None:
        self.path, self.raw = path, RawFile(path)
        starts: list[int] = []
        ends: list[int] = []
        try:
            with open(path, "rb") as handle:
                header = handle.readline()
                self.header = next(csv.reader([header.decode("utf-8-sig")]), [])
                missing = [(c, f) for c, f in [(c, "features") for c in columns] + [(label, "label")]
                           if c not in self.header]
                if missing:
                    raise SpecError(f"data.{missing[0][1]}: no column {missing[0][0]!r} in {path} "
                                    f"(columns: {', '.join(self.header) or 'none: no header row'})")
                self.take = [self.header.index(c) for c in columns]
                self.label_at = self.header.index(label)
                self.integer, self.low, self.high = True, 0, -1
                pos, pending, record, start = len(header), [], b"", 0
                for line in handle:
                    if not record:
                        if not line.strip():
                            pos += len(line)
                            continue
                        start = pos
                    record += line
                    pos += len(line)
                    if record.count(b'"') % 2:  # inside a quoted field: its line break is part of the value
                        continue
                    starts.append(start)
                    ends.append(pos)
                    pending.append(record)
                    record = b""
                    if len(pending) == _SCAN_LINES:
                        self._scan_labels(pending, len(starts) - len(pending))
                        pending = []
                if record:
                    raise SpecError(f"data.{field}: row {len(starts) + 1} of {path} opens a quoted field that "
                                    "never closes")
                self._scan_labels(pending, len(starts) - len(pending))
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"data.{field}: cannot read {path}: {exc}") from exc
        if not starts:
            raise SpecError(f"data.{field}: {path} has no data rows")
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)

    def _scan_labels(self, lines: list[bytes], first: int) -> None:
        if not lines:
            return
        values = [row[self.label_at] if len(row) > self.label_at else None
                  for row in csv.reader(line.decode("utf-8") for line in lines)]
        if None in values:
            bad = first + values.index(None) + 1
            raise SpecError(f"data.label: row {bad} of {self.path} has no {self.header[self.label_at]!r} value")
        if self.integer and all(_is_int(v) for v in values):
            ints = [int(v) for v in values]
            self.low = min(ints) if first == 0 else min(self.low, min(ints))
            self.high = max(self.high, max(ints))
            return
        self.integer = False
        for k, v in enumerate(values):
            try:
                float(v)
            except ValueError:
                raise SpecError(f"data.label: row {first + k + 1} of {self.path} has {v!r}, not a number") from None

    def rows(self, local: np.ndarray) -> list[list[str]]:
        lines = [self.raw.read(int(self.starts[i]), int(self.ends[i] - self.starts[i])) for i in local]
        return list(csv.reader(line.decode("utf-8") for line in lines))


class CsvSource:
    """The data rows of one or more CSV files, read by byte offset."""

    def __init__(self, files: list[Path], features: tuple[str, ...], label: str, field: str) -> None:
        self.files = [CsvFile(p, field, features, label) for p in files]
        self.paths, self.width = files, len(features)
        self.task = "classification" if all(f.integer for f in self.files) else "regression"
        self.y_dtype = np.int64 if self.task == "classification" else np.float32
        self.offsets = np.concatenate([[0], np.cumsum([len(f.starts) for f in self.files])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        x = np.empty((len(indices), self.width), dtype=np.float32)
        y = np.empty(len(indices), dtype=self.y_dtype)
        for f in np.unique(which):
            take = which == f
            file, local = self.files[f], indices[take] - self.offsets[f]
            rows = file.rows(local)
            columns = [*file.take, file.label_at]
            try:
                values = np.array([[row[c] for c in columns] for row in rows], dtype=np.float64)
            except (IndexError, ValueError):
                raise SpecError(self._bad_row(file, local, rows, columns)) from None
            x[take], y[take] = values[:, :-1], values[:, -1]
        return x, y

    @staticmethod
    def _bad_row(file: CsvFile, local: np.ndarray, rows: list[list[str]], columns: list[int]) -> str:
        for i, row in zip(local, rows):
            for c in columns:
                field = "label" if c == file.label_at else "features"
                if c >= len(row):
                    return f"data.{field}: row {i + 1} of {file.path} has {len(row)} values, no {file.header[c]!r}"
                try:
                    float(row[c])
                except ValueError:
                    return f"data.{field}: row {i + 1} of {file.path} has {row[c]!r} in {file.header[c]!r}, not a number"
        return f"data.path: cannot parse rows of {file.path}"

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self), seed, epoch)


def open_csv(spec: DataSpec, seed: int) -> Data:
    """``data.path`` (a file, a directory of ``*.csv`` or a glob), ``data.features`` and ``data.label``."""
    assert spec.path is not None and spec.features is not None and spec.label is not None

    def one(path: str, field: str) -> CsvSource:
        return CsvSource(expand(path, field, (".csv",)), tuple(spec.features or ()), spec.label or "", field)

    train = one(spec.path, "path")
    val = one(spec.val_path, "val_path") if spec.val_path else None
    sources = [train] if val is None else [train, val]
    task = "classification" if all(s.task == "classification" for s in sources) else "regression"
    high = 0
    for source in sources:
        source.task, source.y_dtype = task, (np.int64 if task == "classification" else np.float32)
        if task == "classification":
            for file in source.files:
                check_label_range(file.low, file.high, spec.classes, str(file.path))
                high = max(high, file.high)
    info = DatasetInfo(input_shape=(train.width,), num_outputs=num_outputs(task, spec.classes, high), task=task)
    return assemble(*pair(train, val, spec.val_fraction, seed), info, "every row once per epoch, fully shuffled")

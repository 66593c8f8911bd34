"""``data.name: csv`` — small tabular data in comma-separated files with a header row naming the columns.

Opening reads each file once with the ``csv`` module, keeping only where each record starts and ends (its
byte offsets) and the label column's range; a batch reads its records back by offset (``os.pread``) and
parses them with the ``csv`` module again. Record boundaries are the ``csv`` module's own (`records`): a
quoted field may hold commas, doubled quotes and line breaks (a record then spans lines), and a ``"``
inside an unquoted field is a plain character. Map-style: the epoch's order is a full shuffle of the rows.
"""

from __future__ import annotations

import csv
import re
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from polytrain.data.files import RawFile, assemble, check_apart, check_label_range, expand, num_outputs, pair
from polytrain.data.plan import shuffled
from polytrain.data.source import Data, DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SCAN_ROWS = 65536  # labels checked this many rows at a time while scanning
#: the ``csv`` module refuses fields over 128 KiB by default; any field it can hold is read instead
_FIELD_LIMIT = 2**31 - 1
#: a line fed after the file's last: a record of its own, unless a quoted field never closed (it is then in it)
_END = "\ue000polytrain: end of file\ue001"
_LONE_CR = re.compile(rb"(?<=\r)(?!\n)")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _lines(handle: BinaryIO) -> Iterator[bytes]:
    """The file's lines as ``open(newline="")`` gives them to the ``csv`` module: ending in ``\\n``,
    ``\\r\\n`` or a lone ``\\r`` (a binary file's iteration splits at ``\\n`` only)."""
    for line in handle:
        cr = line.find(b"\r")
        if cr < 0 or (cr == len(line) - 2 and line.endswith(b"\r\n")):
            yield line
        else:
            yield from (part for part in _LONE_CR.split(line) if part)


def records(handle: BinaryIO, path: Path, field: str) -> Iterator[tuple[int, int, list[str]]]:
    """``(start, end, values)`` of every record of a CSV file, header included, found by the ``csv`` module
    itself: a record is the lines the reader consumed for it. Blank lines are no record. A ``csv.Error`` or
    a quoted field still open at the end of the file is a `SpecError` naming the file and the row."""
    if csv.field_size_limit() < _FIELD_LIMIT:
        csv.field_size_limit(_FIELD_LIMIT)
    pos = 0
    ended = False

    def feed() -> Iterator[str]:
        nonlocal pos, ended
        for line in _lines(handle):
            text = line.decode("utf-8-sig" if pos == 0 else "utf-8")
            pos += len(line)
            yield text
        ended = True
        yield _END + "\n"

    reader = csv.reader(feed())
    start, row = 0, 0
    while True:
        try:
            values = next(reader, None)
        except csv.Error as exc:
            raise SpecError(f"data.{field}: {_row_name(row)} of {path} (line {reader.line_num}) is not valid CSV: "
                            f"{exc}") from None
        if values is None:
            return
        if ended:
            if values != [_END]:  # the end line went into a field: a quoted one was still open
                raise SpecError(f"data.{field}: {_row_name(row)} of {path} opens a quoted field that never closes")
            return
        if values and not (len(values) == 1 and not values[0].strip()):
            yield start, pos, values
            row += 1
        start = pos


def _row_name(row: int) -> str:
    return f"row {row}" if row else "the header row"


class CsvFile:
    """One file: its header, every row's byte offset and length, and its label column's kind and range."""

    def __init__(self, path: Path, field: str, columns: tuple[str, ...], label: str) -> None:
        self.path, self.raw = path, RawFile(path)
        starts, ends = array("q"), array("q")
        try:
            with open(path, "rb") as handle:
                found = records(handle, path, field)
                header = next(found, None)
                self.header = header[2] if header is not None else []
                missing = [(c, f) for c, f in [(c, "features") for c in columns] + [(label, "label")]
                           if c not in self.header]
                if missing:
                    raise SpecError(f"data.{missing[0][1]}: no column {missing[0][0]!r} in {path} "
                                    f"(columns: {', '.join(self.header) or 'none: no header row'})")
                self.take = [self.header.index(c) for c in columns]
                self.label_at = self.header.index(label)
                self.integer, self.low, self.high = True, 0, -1
                pending: list[str] = []
                for start, end, values in found:
                    if len(values) <= self.label_at:
                        raise SpecError(f"data.label: row {len(starts) + 1} of {path} has no "
                                        f"{self.header[self.label_at]!r} value")
                    starts.append(start)
                    ends.append(end)
                    pending.append(values[self.label_at])
                    if len(pending) == _SCAN_ROWS:
                        self._scan_labels(pending, len(starts) - len(pending))
                        pending = []
                self._scan_labels(pending, len(starts) - len(pending))
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"data.{field}: cannot read {path}: {exc}") from exc
        if not starts:
            raise SpecError(f"data.{field}: {path} has no data rows")
        self.starts = np.frombuffer(starts, dtype=np.int64)
        self.ends = np.frombuffer(ends, dtype=np.int64)

    def _scan_labels(self, values: list[str], first: int) -> None:
        if not values:
            return
        if self.integer and all(_is_int(v) for v in values):
            ints = [int(v) for v in values]
            self.low = min(ints) if first == 0 else min(self.low, min(ints))
            self.high = max(self.high, max(ints))
            return
        self.integer = False
        for k, v in enumerate(values):
            try:
                number = float(v)
            except ValueError:
                raise SpecError(f"data.label: row {first + k + 1} of {self.path} has {v!r}, not a number") from None
            if not abs(number) <= _FLOAT32_MAX:  # NaN fails too
                raise SpecError(f"data.label: row {first + k + 1} of {self.path} has {v!r}; labels must be finite "
                                "numbers (float32)")

    def rows(self, local: np.ndarray) -> list[list[str]]:
        texts = [self.raw.read(int(self.starts[i]), int(self.ends[i] - self.starts[i])).decode("utf-8")
                 for i in local]
        return [next(csv.reader([text]), []) for text in texts]


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
            finite = np.abs(values) <= _FLOAT32_MAX  # NaN, ±Inf and what float32 cannot hold
            if not finite.all():
                r, c = np.argwhere(~finite)[0]
                field = "label" if columns[c] == file.label_at else "features"
                raise SpecError(f"data.{field}: row {local[r] + 1} of {file.path} has {rows[r][columns[c]]!r} in "
                                f"{file.header[columns[c]]!r}; values must be finite numbers (float32)")
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
    if val is not None:
        check_apart(train.paths, val.paths)
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

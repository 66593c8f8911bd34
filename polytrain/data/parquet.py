"""``data.name: parquet`` — Parquet files (what pandas and HF ``datasets`` write), read one row group at a time.

Opening reads each file's footer and, for integer labels, the label column's row-group statistics (or
the label column alone, row group by row group, where a writer left none). A batch decodes the row
groups its samples live in (only the feature and label columns) through a small cache of decoded row
groups; nothing reads a whole table. The epoch's order permutes the row groups, then shuffles the rows
inside each window of ``data.shuffle_window`` consecutive (permuted) row groups: every row exactly once
per epoch, with a batch touching about ``shuffle_window`` row groups rather than all of them.

Memory: the cache holds ``shuffle_window + 2`` decoded row groups (the batches that cross from one window
into the next use the old window's groups first, so each row group is decoded once an epoch), plus about
a MiB of Arrow buffers per reader thread. A file's row-group size is the writer's choice: pyarrow's default
of 1 Mi rows can make one of hundreds of MiB, so write with ``row_group_size`` giving tens of MiB at most.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from polytrain.data.files import (
    BlockCache,
    assemble,
    check_apart,
    check_label_range,
    expand,
    first_nonfinite,
    label_task,
    num_outputs,
    pair,
)
from polytrain.data.source import Data, DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec

Block = tuple[np.ndarray, np.ndarray]
#: Arrow's allocator keeps what a decode freed for its next allocation; handing it back costs about as much
#: as decoding 10,000 rows, so it is done every few decodes. Measured with row groups of 3 MiB: after every
#: decode, 25% less read throughput; after every 4th, the same peak RSS; never, 15-20 MiB more.
_RELEASE_EVERY = 4


def _anonymous(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An array in its own anonymous memory map: handed back to the system the moment the cache drops it
    (``malloc`` would keep freed blocks of this size in per-thread arenas, tens of MiB above the cache)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # one fault, not one a page
    buffer = mmap.mmap(-1, max(size, 1), flags=flags)
    return np.frombuffer(buffer, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _numeric(tp: pa.DataType) -> bool:
    return pa.types.is_integer(tp) or pa.types.is_floating(tp) or pa.types.is_boolean(tp)


def _is_list(tp: pa.DataType) -> bool:
    return pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp)


def _label_kind(tp: pa.DataType, where: str) -> str:
    if pa.types.is_integer(tp) or pa.types.is_boolean(tp):
        return "i"
    if pa.types.is_floating(tp):
        return "f"
    raise SpecError(f"data.label: column in {where} has type {tp}; labels must be integers (classes) or floats")


class ParquetSource:
    """The rows of one or more Parquet files, as one map-style source read by row group."""

    def __init__(self, files: list[Path], features: tuple[str, ...], label: str, *, window: int, field: str) -> None:
        self.paths, self.features, self.label, self.window, self.field = files, features, label, window, field
        self._meta: list[pq.FileMetaData] = []
        self.groups: list[tuple[int, int]] = []  # (file, row group) of each global row group
        rows: list[int] = []
        kinds, widths = set(), set()
        for f, path in enumerate(files):
            meta, schema = self._open(path)
            self._meta.append(meta)
            kinds.add(self._check_columns(schema, path))
            widths.add(self._width(schema, path, f))
            for i in range(meta.num_row_groups):
                self.groups.append((f, i))
                rows.append(meta.row_group(i).num_rows)
        if len(widths) > 1 or len(kinds) > 1:
            raise SpecError(f"data.{field}: the files of {field} disagree on the feature width or label type "
                            f"(widths {sorted(widths)}, label kinds {sorted(kinds)}): {files[0]} ...")
        self.rows = np.asarray(rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)
        if self.starts[-1] == 0:
            raise SpecError(f"data.{field}: no rows in {', '.join(map(str, files[:3]))}")
        self.width, self.task = widths.pop(), label_task(kinds.pop(), str(files[0]))
        self.y_dtype = np.int64 if self.task == "classification" else np.float32
        self._cache: BlockCache[Block] = BlockCache(window + 2)

    def _open(self, path: Path) -> tuple[pq.FileMetaData, pa.Schema]:
        try:
            with pq.ParquetFile(path) as handle:
                return handle.metadata, handle.schema_arrow
        except (OSError, pa.ArrowException) as exc:
            raise SpecError(f"data.{self.field}: {path} is not a readable Parquet file: {exc}") from exc

    def _check_columns(self, schema: pa.Schema, path: Path) -> str:
        for name, field in [(c, "features") for c in self.features] + [(self.label, "label")]:
            if schema.get_field_index(name) < 0:
                raise SpecError(f"data.{field}: no column {name!r} in {path} (columns: {', '.join(schema.names)})")
        return _label_kind(schema.field(self.label).type, str(path))

    def _width(self, schema: pa.Schema, path: Path, f: int) -> int:
        """Features per row: the number of scalar columns, or the length of the one array column's arrays."""
        types = [schema.field(c).type for c in self.features]
        if len(types) == 1 and _is_list(types[0]):
            self.array = True
            value_type = types[0].value_type
            if not _numeric(value_type):
                raise SpecError(f"data.features: column {self.features[0]!r} in {path} holds {value_type} arrays; "
                                "features must be numeric")
            if pa.types.is_fixed_size_list(types[0]):
                return types[0].list_size
            for i in range(self._meta[f].num_row_groups):  # a variable-size list column: its first row says
                lengths = self._lengths(self._read(f, i, [self.features[0]]).column(0).combine_chunks())
                if len(lengths):
                    return int(lengths[0])
            return 0
        self.array = False
        for name, tp in zip(self.features, types):
            if not _numeric(tp):
                raise SpecError(f"data.features: column {name!r} in {path} has type {tp}; features must be numeric "
                                "scalars, or one column of fixed-size numeric arrays")
        return len(types)

    @staticmethod
    def _lengths(column: pa.Array) -> np.ndarray:
        if pa.types.is_fixed_size_list(column.type):
            return np.full(len(column), column.type.list_size)
        return pc.list_value_length(column).to_numpy(zero_copy_only=False)

    def _read(self, f: int, i: int, columns: list[str]) -> pa.Table:
        path = self.paths[f]
        try:
            # pre_buffer off, one thread: the reader threads already run in parallel, and a row group's
            # transient memory stays at about its decoded size
            with pq.ParquetFile(path, metadata=self._meta[f], pre_buffer=False) as handle:
                return handle.read_row_group(i, columns=columns, use_threads=False)
        except (OSError, pa.ArrowException) as exc:
            raise SpecError(f"data.{self.field}: cannot read row group {i} of {path}: {exc}") from exc

    def label_range(self, classes: int | None) -> tuple[int, int]:
        """(smallest, largest) integer label, from the row-group statistics or the label column alone; each
        row group's labels are checked against ``classes``."""
        low, high = None, None
        for g, (f, i) in enumerate(self.groups):
            if self.rows[g] == 0:
                continue
            lo, hi = self._group_label_range(f, i)
            low, high = lo if low is None else min(low, lo), hi if high is None else max(high, hi)
            check_label_range(lo, hi, classes, f"{self.paths[f]} (row group {i})")
        assert low is not None and high is not None
        return low, high

    def _group_label_range(self, f: int, i: int) -> tuple[int, int]:
        group = self._meta[f].row_group(i)
        for c in range(group.num_columns):
            column = group.column(c)
            stats = column.statistics
            if column.path_in_schema == self.label and stats is not None and stats.has_min_max \
                    and stats.has_null_count and stats.null_count == 0:
                return int(stats.min), int(stats.max)
        labels = self._read(f, i, [self.label]).column(0)
        self._no_nulls(labels, self.label, "label", f, i)
        bounds = pc.min_max(labels)
        return int(bounds["min"].as_py()), int(bounds["max"].as_py())

    def _no_nulls(self, column: pa.ChunkedArray | pa.Array, name: str, field: str, f: int, i: int) -> None:
        if column.null_count:
            raise SpecError(f"data.{field}: column {name!r} has {column.null_count} missing values in "
                            f"{self.paths[f]} (row group {i})")

    def _decode(self, g: int) -> Block:
        """Row group ``g`` as numpy (x, y), filled about a MiB of rows at a time: Arrow's transient memory stays
        at one such chunk whatever the row-group size, and what is cached lives in its own memory maps."""
        f, i = self.groups[g]
        n = int(self.rows[g])
        x, y = _anonymous((n, self.width), np.float32), _anonymous((n,), self.y_dtype)
        chunk_rows = max(16, (1 << 20) // (4 * max(self.width, 1) + 8))
        at = 0
        try:
            with pq.ParquetFile(self.paths[f], metadata=self._meta[f], pre_buffer=False) as handle:
                for batch in handle.iter_batches(chunk_rows, row_groups=[i], columns=[*self.features, self.label],
                                                 use_threads=False):
                    k = batch.num_rows
                    self._fill(batch, x[at:at + k], y[at:at + k], f, i, at)
                    at += k
        except (OSError, pa.ArrowException) as exc:
            raise SpecError(f"data.{self.field}: cannot read row group {i} of {self.paths[f]}: {exc}") from exc
        if self._cache.decodes % _RELEASE_EVERY == _RELEASE_EVERY - 1:
            pa.default_memory_pool().release_unused()
        if at != n:
            raise SpecError(f"data.{self.field}: row group {i} of {self.paths[f]} has {at} rows, its footer says {n}")
        return x, y

    def _finite(self, values: np.ndarray, name: str, field: str, f: int, i: int, at: int) -> None:
        bad = first_nonfinite(values)
        if bad is not None:
            raise SpecError(f"data.{field}: column {name!r} has NaN or Inf (or a value float32 cannot hold) in "
                            f"{self.paths[f]} (row group {i}, row {at + bad}); values must be finite numbers")

    def _fill(self, batch: pa.RecordBatch, x: np.ndarray, y: np.ndarray, f: int, i: int, at: int) -> None:
        """Row group ``i``'s rows ``at`` .. ``at + len(x)`` of file ``f`` into ``x`` and ``y``, checked."""
        labels = batch.column(self.label)
        self._no_nulls(labels, self.label, "label", f, i)
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes Inf: refused just below
            y[:] = labels.to_numpy(zero_copy_only=False)
        self._finite(y, self.label, "label", f, i, at)
        if not self.array:
            for k, name in enumerate(self.features):
                column = batch.column(name)
                self._no_nulls(column, name, "features", f, i)
                with np.errstate(over="ignore"):
                    x[:, k] = column.to_numpy(zero_copy_only=False)
                self._finite(x[:, k], name, "features", f, i, at)
            return
        column = batch.column(self.features[0])
        self._no_nulls(column, self.features[0], "features", f, i)
        lengths = self._lengths(column)
        if len(lengths) and (lengths != self.width).any():
            bad = int(lengths[lengths != self.width][0])
            raise SpecError(f"data.features: column {self.features[0]!r} in {self.paths[f]} (row group {i}) "
                            f"holds arrays of length {bad}, not {self.width} like the first row's")
        values = column.flatten()
        self._no_nulls(values, self.features[0], "features", f, i)
        with np.errstate(over="ignore"):
            x[:] = values.to_numpy(zero_copy_only=False).reshape(len(x), self.width)
        self._finite(x, self.features[0], "features", f, i, at)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        groups = np.searchsorted(self.starts, indices, side="right") - 1
        x = np.empty((len(indices), self.width), dtype=np.float32)
        y = np.empty(len(indices), dtype=self.y_dtype)
        # row groups in the order the batch first reaches them: a batch that crosses from one shuffle window into
        # the next uses the old window's groups first, so the cache's least recently used are the old ones
        unique, first = np.unique(groups, return_index=True)
        for g in unique[np.argsort(first)]:
            take = groups == g
            gx, gy = self._cache.get(int(g), lambda g=int(g): self._decode(g))
            local = indices[take] - self.starts[g]
            x[take], y[take] = gx[local], gy[local]
        return x, y

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """Row groups permuted, then the rows of each window of ``window`` consecutive groups shuffled together."""
        rng = np.random.default_rng([seed, epoch])
        groups = rng.permutation(len(self.groups))
        out, at = np.empty(len(self), dtype=np.int64), 0
        for w in range(0, len(groups), self.window):
            rows = np.concatenate([np.arange(self.starts[g], self.starts[g + 1]) for g in groups[w:w + self.window]])
            out[at:at + len(rows)] = rng.permutation(rows)
            at += len(rows)
        return out


def open_parquet(spec: DataSpec, seed: int) -> Data:
    """``data.path`` (a file, a directory of ``*.parquet`` or a glob), ``data.features`` and ``data.label``."""
    assert spec.path is not None and spec.features is not None and spec.label is not None

    def one(path: str, field: str) -> ParquetSource:
        return ParquetSource(expand(path, field, (".parquet",)), tuple(spec.features or ()), spec.label or "",
                             window=spec.shuffle_window, field=field)

    train = one(spec.path, "path")
    val = one(spec.val_path, "val_path") if spec.val_path else None
    if val is not None:
        check_apart(train.paths, val.paths)
    if val is not None and (val.width, val.task) != (train.width, train.task):
        raise SpecError(f"data.val_path: {val.paths[0]} has {val.width} features and {val.task} labels; "
                        f"data.path has {train.width} and {train.task}")
    high = 0
    if train.task == "classification":
        for source in (train, val) if val is not None else (train,):
            high = max(high, source.label_range(spec.classes)[1])
    info = DatasetInfo(input_shape=(train.width,), num_outputs=num_outputs(train.task, spec.classes, high),
                       task=train.task)
    guarantee = (f"every row once per epoch; row groups permuted, rows shuffled within windows of "
                 f"{spec.shuffle_window} row groups (seed, epoch)")
    return assemble(*pair(train, val, spec.val_fraction, seed), info, guarantee)

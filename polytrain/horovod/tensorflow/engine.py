"""Horovod's collective semantics on numpy buffers, moved by MPI (mpi4py) — no TensorFlow here.

Every collective starts with a *control round*: one small ``Allgather`` in which each rank
says what it is about to do (kind, reduce op, dtype, element count, root, first dimension,
a hash of the shapes). That one message buys three things Horovod's coordinator gives:

* a clear error on every rank, instead of a hang or garbage, when ranks disagree
  (different shapes, dtypes, ops or roots);
* the first dimensions every rank contributes to an allgather, without a second exchange;
* ``join()``: a rank that has joined keeps answering control rounds and contributes zeros
  to the allreduces the others still run (Horovod 0.28.1 semantics: ``Average`` still
  divides by the full size; allgather, broadcast, alltoall and reducescatter are errors
  while a rank is joined).

Ranks must issue collectives in the same order; the TensorFlow layer guarantees that by
chaining its ops (see `ops`). The data moves through `polytrain.comm.mpi_transport.MpiTransport`
(or `LocalTransport` in a one-process job without MPI).
"""

from __future__ import annotations

import functools
import sys
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from polytrain.comm.mpi_transport import plan_buckets, wait, wire_dtype
from polytrain.horovod.common import REDUCTIONS, Average, Sum, split_rows
from polytrain.horovod.common.settings import DEFAULT_FUSION_THRESHOLD

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN = range(1, 8)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall",
              REDUCESCATTER: "reducescatter", BARRIER: "barrier", JOIN: "join"}
# control row columns
ACTIVE, KIND, OP, DTYPE, COUNT, ROOT, FIRST_DIM, SHAPES = range(8)
_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
           "bfloat16", "float32", "float64", "complex64", "complex128")


class CollectiveError(RuntimeError):
    """Ranks asked for incompatible collectives (raised on every rank, so nobody hangs)."""


def _dtype_code(dtype: np.dtype) -> int:
    return _DTYPES.index(np.dtype(dtype).name) if np.dtype(dtype).name in _DTYPES else len(_DTYPES)


def _shape_hash(shapes: Sequence[Sequence[int]]) -> int:
    return zlib.crc32(repr([tuple(int(d) for d in s) for s in shapes]).encode())


class _Completed:
    """The request of a collective that completed when it was issued."""

    @staticmethod
    def Test() -> bool:  # noqa: N802 - mpi4py's name
        return True


class LocalTransport:
    """The transport of a one-process job without MPI: every collective is a copy."""

    rank, size = 0, 1

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> _Completed:
        recv[...] = send.reshape(recv.shape)
        return _Completed()

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        pass

    def allgatherv(self, send: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        return send.copy()

    def bcast(self, buf: np.ndarray, root: int) -> None:
        pass

    def alltoall(self, send: np.ndarray) -> np.ndarray:
        return send.copy()

    def alltoallv(self, send: np.ndarray, sendcounts: Sequence[int], recvcounts: Sequence[int]) -> np.ndarray:
        return send.copy()

    def reduce_scatter(self, buf: np.ndarray, counts: Sequence[int], op: str = "sum") -> np.ndarray:
        return buf.copy()

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)


def _serialized(method):
    """Run an Engine collective under the engine's lock."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class Engine:
    """Horovod's collectives (reduce ops, scaling, uneven allgather, join) over a transport.

    A control round still incomplete after ``stall_seconds`` prints that this rank is stuck
    (Horovod's stall warning); after ``shutdown_seconds`` it aborts the job.
    """

    def __init__(self, transport: Any, *, fusion_threshold: int = DEFAULT_FUSION_THRESHOLD,
                 check_metadata: bool = True, stall_seconds: float | None = None,
                 shutdown_seconds: float | None = None) -> None:
        self.t = transport
        self.rank, self.size = transport.rank, transport.size
        self.fusion_threshold = fusion_threshold
        self.check_metadata = check_metadata
        self.stall_seconds = stall_seconds
        self.shutdown_seconds = shutdown_seconds
        self._watch = None if stall_seconds is None and shutdown_seconds is None else _StallWatch(self)
        self._active_before = np.ones(self.size, dtype=bool)
        # one collective at a time per process, whichever thread (eager code, tf.function) issues it
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ control rounds
    def _control(self, row: np.ndarray) -> np.ndarray:
        """Every rank's control row, waited for without spinning a core and watched for stalls."""
        table = np.empty((self.size, row.size), dtype=np.int64)
        request = self.t.start_allgather(row, table)
        if self._watch is None:
            wait(request)
        else:
            self._watch.kind, self._watch.warned = int(row[KIND]), False
            wait(request, on_wait=self._watch)
        return table

    def _round(self, kind: int, *, op: int = 0, dtype: int = 0, count: int = 0, root: int = -1,
               first_dim: int = 0, shapes: int = 0) -> np.ndarray:
        row = np.array([1, kind, op, dtype, count, root, first_dim, shapes], dtype=np.int64)
        table = self._control(row)
        active = table[:, ACTIVE] == 1
        if not active.all() and kind != ALLREDUCE:
            joined = [int(r) for r in np.flatnonzero(~active)]
            raise CollectiveError(f"{KIND_NAMES[kind]} is not supported while ranks {joined} have called "
                                  "join() (Horovod supports only allreduce with join)")
        self._active_before = active
        if self.check_metadata:
            self._check(table, np.flatnonzero(active), kind)
        return table

    def _check(self, table: np.ndarray, ranks: np.ndarray, kind: int) -> None:
        must_agree = [KIND, OP, DTYPE, COUNT, ROOT, SHAPES]
        if kind == ALLGATHER or kind == ALLTOALL:
            must_agree = [KIND, DTYPE, COUNT, SHAPES]  # first dimensions may differ
        for col in must_agree:
            column = table[ranks, col]
            if (column != column[0]).any():
                what = {KIND: "collective", OP: "reduce op", DTYPE: "dtype", COUNT: "size",
                        ROOT: "root rank", SHAPES: "tensor shapes"}[col]
                seen = {int(r): KIND_NAMES.get(int(v), "?") if col == KIND else int(v)
                        for r, v in zip(ranks, column)}
                raise CollectiveError(f"ranks disagree on the {what} of this {KIND_NAMES[kind]} (rank: value "
                                      f"{seen}); every rank must issue the same collectives in the same order "
                                      "with matching tensors")

    @_serialized
    def join(self) -> int:
        """Contribute zeros to the others' allreduces until every rank has joined; the last joiner."""
        while True:
            row = np.array([0, JOIN, 0, 0, 0, -1, 0, 0], dtype=np.int64)
            table = self._control(row)
            active = table[:, ACTIVE] == 1
            if not active.any():
                last = int(np.flatnonzero(self._active_before)[-1])
                self._active_before = np.ones(self.size, dtype=bool)
                return last
            self._active_before = active
            first = table[np.flatnonzero(active)[0]]
            if first[KIND] != ALLREDUCE:
                raise CollectiveError(f"{KIND_NAMES.get(int(first[KIND]), '?')} is not supported while this "
                                      f"rank ({self.rank}) has called join() (Horovod supports only allreduce)")
            zeros = np.zeros(int(first[COUNT]), dtype=np.dtype(_DTYPES[int(first[DTYPE])]))
            self.t.allreduce(zeros, REDUCTIONS[int(first[OP])])

    @_serialized
    def barrier(self) -> None:
        self._round(BARRIER)

    # ------------------------------------------------------------------ reductions
    @_serialized
    def allreduce(self, arrays: Sequence[np.ndarray], op: int, prescale: float = 1.0,
                  postscale: float = 1.0) -> list[np.ndarray]:
        """Reduce every array across ranks; arrays of one dtype travel fused, up to the fusion threshold."""
        if op not in REDUCTIONS:
            raise CollectiveError(f"reduce op {op} is not supported by polytrain's MPI engine")
        after = postscale / self.size if op == Average else postscale
        out: list[np.ndarray | None] = [None] * len(arrays)
        arrays = [np.asarray(a) for a in arrays]
        for idx in plan_buckets(arrays, self.fusion_threshold):
            group = [arrays[i] for i in idx]
            wire = wire_dtype(group[0].dtype)
            if wire == np.bool_:
                raise CollectiveError("allreduce of bool tensors is not supported; cast to an integer type")
            # one copy into a buffer of our own (the inputs are TensorFlow's), reduced in place
            flat = np.concatenate([g.reshape(-1) for g in group], dtype=wire, casting="same_kind")
            flat = _scaled(flat, prescale)
            self._round(ALLREDUCE, op=op, dtype=_dtype_code(wire), count=flat.size,
                        shapes=_shape_hash([g.shape for g in group]))
            self.t.allreduce(flat, REDUCTIONS[op])
            flat = _scaled(flat, after)
            offset = 0
            for i, g in zip(idx, group):
                out[i] = flat[offset:offset + g.size].reshape(g.shape).astype(g.dtype, copy=False)
                offset += g.size
        return out  # type: ignore[return-value]

    @_serialized
    def reducescatter(self, array: np.ndarray, op: int, prescale: float = 1.0,
                      postscale: float = 1.0) -> np.ndarray:
        array = np.asarray(array)
        if op not in (Sum, Average):
            raise CollectiveError("reducescatter supports only Sum and Average (as Horovod)")
        if array.ndim == 0:
            raise CollectiveError("reducescatter of a rank-zero tensor is not supported (as Horovod)")
        wire = wire_dtype(array.dtype)
        flat = _scaled(array.reshape(-1).astype(wire), prescale)
        self._round(REDUCESCATTER, op=op, dtype=_dtype_code(wire), count=flat.size,
                    shapes=_shape_hash([array.shape]))
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        rows = split_rows(array.shape[0], self.size)
        mine = self.t.reduce_scatter(flat, [r * row for r in rows], REDUCTIONS[op])
        after = postscale / self.size if op == Average else postscale
        return _scaled(mine, after).reshape((rows[self.rank],) + array.shape[1:]).astype(array.dtype, copy=False)

    # ------------------------------------------------------------------ data movement
    @_serialized
    def allgather(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate along the first dimension (which may differ per rank); also each rank's rows."""
        array = np.asarray(array)
        if array.ndim == 0:
            raise CollectiveError("allgather of a rank-zero tensor is not supported; reshape it to [1]")
        row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
        table = self._round(ALLGATHER, dtype=_dtype_code(array.dtype), count=row_bytes,
                            first_dim=array.shape[0], shapes=_shape_hash([array.shape[1:]]))
        rows = table[:, FIRST_DIM]
        data = self.t.allgatherv(_bytes(array), [int(r) * row_bytes for r in rows])
        out = data.view(array.dtype).reshape((int(rows.sum()),) + array.shape[1:])
        return out, rows.astype(np.int32)

    @_serialized
    def broadcast(self, arrays: Sequence[np.ndarray], root: int) -> list[np.ndarray]:
        """Root's values of every array, moved as one byte buffer."""
        if not 0 <= root < self.size:
            raise CollectiveError(f"root_rank={root} is not a rank; it must be in 0..{self.size - 1}")
        arrays = [np.asarray(a) for a in arrays]
        buf = np.concatenate([_bytes(a) for a in arrays] or [np.zeros(0, np.uint8)])  # our own copy
        codes = [_dtype_code(a.dtype) for a in arrays]
        self._round(BROADCAST, dtype=zlib.crc32(bytes(codes)), count=buf.size, root=root,
                    shapes=_shape_hash([a.shape for a in arrays]))
        self.t.bcast(buf, root)
        out, offset = [], 0
        for a in arrays:
            out.append(buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape))
            offset += a.nbytes
        return out

    @_serialized
    def alltoall(self, array: np.ndarray, splits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Send ``splits[r]`` first-dimension slices to rank r; received tensor and received splits."""
        array = np.asarray(array)
        if array.ndim == 0:
            raise CollectiveError("alltoall of a rank-zero tensor is not supported")
        rows = array.shape[0]
        if splits is None or np.asarray(splits).size == 0:
            if rows % self.size:
                raise CollectiveError(f"alltoall without splits needs a first dimension divisible by the "
                                      f"number of ranks ({rows} rows, {self.size} ranks)")
            splits = np.full(self.size, rows // self.size, dtype=np.int64)
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        if splits.size != self.size or (splits < 0).any() or splits.sum() > rows:
            raise CollectiveError(f"alltoall splits {splits.tolist()} must have one non-negative entry per "
                                  f"rank ({self.size}) summing to at most the first dimension ({rows})")
        row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
        self._round(ALLTOALL, dtype=_dtype_code(array.dtype), count=row_bytes, first_dim=rows,
                    shapes=_shape_hash([array.shape[1:]]))
        received = self.t.alltoall(splits)
        data = self.t.alltoallv(_bytes(array)[:int(splits.sum()) * row_bytes],
                                [int(s) * row_bytes for s in splits], [int(r) * row_bytes for r in received])
        out = data.view(array.dtype).reshape((int(received.sum()),) + array.shape[1:])
        return out, received.astype(np.int32)


def _scaled(a: np.ndarray, factor: float) -> np.ndarray:
    """``a * factor`` in ``a``'s dtype, in place for floats (``a`` is the engine's own buffer);
    integers are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return a
    if np.issubdtype(a.dtype, np.integer):
        return (a.astype(np.float64) * factor).astype(a.dtype)
    a *= np.asarray(factor, dtype=a.dtype)
    return a


class _StallWatch:
    """Called while a control round waits: warns once after the stall time, aborts after the shutdown time."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.kind, self.warned = engine, 0, False

    def __call__(self, waited: float) -> None:
        engine = self.engine
        if engine.stall_seconds is not None and waited > engine.stall_seconds and not self.warned:
            self.warned = True
            print(f"[polytrain.horovod rank {engine.rank}] waited {waited:.0f} s for the other ranks to reach this "
                  f"{KIND_NAMES.get(self.kind, '?')}; ranks that submit different collectives (or none) deadlock",
                  file=sys.stderr, flush=True)
        if engine.shutdown_seconds is not None and waited > engine.shutdown_seconds:
            print(f"[polytrain.horovod rank {engine.rank}] stalled for more than {engine.shutdown_seconds:.0f} s "
                  "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); aborting the job", file=sys.stderr, flush=True)
            engine.t.abort(1)

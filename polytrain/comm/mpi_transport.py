"""MPI on numpy buffers through mpi4py: the one place polytrain moves data over MPI.

`MpiTransport` wraps a communicator: in-place reductions and broadcasts, gathers,
all-to-alls, the non-blocking allgather of small records (waited for with `wait`, which
backs off so a rank waiting for slower ones does not spin a core) and Python objects.
Everything MPI-specific lives here: which dtypes MPI reduces natively (`REDUCIBLE`,
`wire_dtype`), the reduce ops by name, duplicating a communicator, fusion buckets.
Built on it: `MpiCollectives` (the ``mpi`` training backends of torch and TensorFlow),
the torch Horovod shim's MPI channel (``polytrain.horovod.torch.mpi``) and the TensorFlow
Horovod shim's engine (``polytrain.horovod.tensorflow.engine``).

Fusion: the ``mpi`` backends average gradients with ``MPI_Allreduce`` on contiguous numpy
buffers. Small arrays are packed into buckets of up to ``POLYTRAIN_MPI_FUSION_BYTES``
(default 64 MiB) so a model with many small tensors costs a few collectives instead of
hundreds; an array larger than the threshold is reduced on its own, in place.
``POLYTRAIN_MPI_FUSION_BYTES=0`` turns fusion off (one collective per array).

mpi4py is imported only when a transport is made: importing ``mpi4py.MPI`` initialises MPI.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from polytrain.comm.mpi_singleton import keep_singletons_off_shared_memory
from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError
from polytrain.observe.timeline import COLLECTIVES, NULL
from polytrain.protocols import ready

keep_singletons_off_shared_memory()  # before mpi4py starts MPI (see polytrain.comm.mpi_singleton)

DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
FUSION_ENV = "POLYTRAIN_MPI_FUSION_BYTES"

#: numpy dtypes MPI reduces natively (its C types); MPI has no 16-bit float reductions.
REDUCIBLE = frozenset({"float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                       "uint64", "complex64", "complex128"})
_MPI_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PROD"}


def fusion_threshold(env: Mapping[str, str] | None = None) -> int:
    """The bucket size in bytes from ``POLYTRAIN_MPI_FUSION_BYTES`` (default 64 MiB; 0 = no fusion)."""
    raw = (os.environ if env is None else env).get(FUSION_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_FUSION_BYTES
    except ValueError:
        raise EnvironmentDetectionError(
            f"{FUSION_ENV}={raw!r} is not an integer; it must be a number of bytes >= 0 (0 = no fusion)") from None
    if value < 0:
        raise EnvironmentDetectionError(f"{FUSION_ENV}={value} is negative; it must be a number of bytes >= 0")
    return value


def plan_buckets(arrays: Sequence[Any], threshold: int) -> list[list[int]]:
    """Group array indices into fusion buckets: one dtype each, at most ``threshold`` bytes together.

    Arrays need only ``dtype`` and ``nbytes``. Each dtype fills its own open bucket, in order, so
    interleaved dtypes still fuse; an array of ``threshold`` bytes or more (or any array when
    ``threshold`` is 0) is a bucket alone. Buckets come in the order of their first array.
    """
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}  # dtype -> (bucket, bytes in it)
    for i, arr in enumerate(arrays):
        nbytes = arr.nbytes
        if nbytes >= threshold or threshold == 0:
            open_bucket.pop(arr.dtype, None)
            buckets.append([i])
            continue
        bucket, used = open_bucket.get(arr.dtype, (None, 0))
        if bucket is None or used + nbytes > threshold:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(i)
        open_bucket[arr.dtype] = (bucket, used + nbytes)
    return buckets


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an array of ``dtype`` is reduced in: float32 for the 16-bit floats MPI cannot reduce."""
    return np.dtype(np.float32) if dtype.name in ("float16", "bfloat16") else dtype


def mpi_installed() -> bool:
    """Whether mpi4py can be imported (found, not imported: that would initialise MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def wait(request: Any, *, spins: int = 0, timeout: float | None = None,
         on_wait: Callable[[float], None] | None = None) -> bool:
    """Test ``request`` until it completes; False if ``timeout`` seconds pass first.

    After ``spins`` tests it sleeps between tests, backing off to 1 ms, and calls
    ``on_wait(seconds waited)`` after each sleep (stall warnings).
    """
    if request.Test():
        return True
    start = time.monotonic()
    tests, pause = 1, 0.0
    while True:
        if timeout is not None and time.monotonic() - start > timeout:
            return False
        if tests > spins:
            time.sleep(pause)
            pause = min(pause + 5e-5, 1e-3)
            if on_wait is not None:
                on_wait(time.monotonic() - start)
        if request.Test():
            return True
        tests += 1


class MpiTransport:
    """Collectives on numpy buffers over one mpi4py communicator (``MPI_COMM_WORLD`` by default).

    With ``duplicate`` the transport works on its own copy of ``comm`` (a collective call:
    every rank must make it), so its traffic never matches another user's of ``comm``.
    Reduce ops are named: ``sum``, ``min``, ``max``, ``product``.
    """

    def __init__(self, comm: Any = None, *, duplicate: bool = False) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = comm.Dup() if duplicate else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.ops = {name: getattr(MPI, attr) for name, attr in _MPI_OPS.items()}

    def thread_multiple(self) -> bool:
        """Whether MPI was initialised with MPI_THREAD_MULTIPLE (calls from any thread)."""
        return self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE

    def node_records(self) -> list[list[int]]:
        """Every rank's ``[node index, rank on its node, ranks on its node]``, in rank order.

        Nodes are MPI's shared-memory groups, numbered by their lowest rank.
        """
        local = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        leaders = self.comm.allgather(self.rank if local.Get_rank() == 0 else -1)
        node = sorted(r for r in leaders if r >= 0).index(local.bcast(self.rank, root=0))
        records = self.comm.allgather([node, local.Get_rank(), local.Get_size()])
        local.Free()
        return records

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        """Reduce ``buf`` over all ranks, in place."""
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.ops[op])

    def bcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` with ``root``'s, in place."""
        self.comm.Bcast(buf, root=root)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Every rank's ``send`` (all of one size) into ``recv``, in rank order."""
        self.comm.Allgather(send, recv)

    def start_allreduce(self, buf: np.ndarray, op: str = "sum") -> Any:
        """Begin `allreduce` without blocking; the request to `wait` for (``buf`` must outlive it)."""
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.ops[op])

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> Any:
        """Begin `allgather` without blocking; the request to `wait` for (both buffers must outlive it)."""
        return self.comm.Iallgather(send, recv)

    def allgatherv(self, send: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """Every rank's bytes (``counts[r]`` from rank r), concatenated in rank order."""
        recv = np.empty(int(sum(counts)), dtype=np.uint8)
        self.comm.Allgatherv(send, [recv, list(counts)])
        return recv

    def alltoall(self, send: np.ndarray) -> np.ndarray:
        """Element r of ``send`` to rank r; what each rank sent here, in rank order."""
        recv = np.empty_like(send)
        self.comm.Alltoall(send, recv)
        return recv

    def alltoallv(self, send: np.ndarray, sendcounts: Sequence[int], recvcounts: Sequence[int]) -> np.ndarray:
        """``sendcounts[r]`` bytes of ``send`` to rank r; the bytes received, in rank order."""
        recv = np.empty(int(sum(recvcounts)), dtype=np.uint8)
        self.comm.Alltoallv([send, list(sendcounts)], [recv, list(recvcounts)])
        return recv

    def reduce_scatter(self, buf: np.ndarray, counts: Sequence[int], op: str = "sum") -> np.ndarray:
        """Reduce ``buf`` over all ranks and keep this rank's ``counts[rank]`` elements."""
        recv = np.empty(int(counts[self.rank]), dtype=buf.dtype)
        self.comm.Reduce_scatter(buf, recv, list(counts), op=self.ops[op])
        return recv

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every process of the job (a stalled collective cannot be abandoned otherwise)."""
        self.comm.Abort(code)


class MpiCollectives:
    """``MPI_COMM_WORLD`` as a polytrain backend sees it: fused averaging, broadcast, Trainer collectives."""

    def __init__(self, expected_rank: int, expected_size: int, launcher: str,
                 fusion_bytes: int | None = None) -> None:
        try:
            self.transport = MpiTransport()
        except ImportError as exc:
            raise BackendUnavailableError(f"backend: 'mpi' needs mpi4py ({exc}); pip install 'polytrain[mpi]'") from exc
        self.rank, self.size = self.transport.rank, self.transport.size
        if (self.rank, self.size) != (expected_rank, expected_size):
            raise BackendUnavailableError(
                f"backend: 'mpi' sees rank {self.rank} of {self.size} MPI processes, but the launcher ({launcher}) "
                f"says rank {expected_rank} of {expected_size}; start the job with mpirun, srun --mpi or horovodrun")
        self.fusion_bytes = fusion_threshold() if fusion_bytes is None else fusion_bytes
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self.timeline: Any = NULL  # records each bucket's allreduce when a Trainer asks for a timeline

    def _allreduce_bucket(self, index: int, buffer: np.ndarray) -> None:
        """Sum ``buffer`` over all ranks in place, then divide by the number of ranks."""
        started = self.timeline.now()
        self.transport.allreduce(buffer)
        self.timeline.complete(f"gradient bucket {index}", "collective", started, self.timeline.now(),
                               track=COLLECTIVES, op="allreduce", bytes=buffer.nbytes)
        buffer /= self.size

    def _buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._buffers.get(dtype)
        if buf is None or buf.size < count:
            buf = self._buffers[dtype] = np.empty(count, dtype=dtype)
        return buf[:count]

    def average_(self, arrays: Sequence[np.ndarray]) -> int:
        """Replace each array by its mean over all ranks, in place; returns the number of allreduces run.

        Arrays must be C-contiguous and writeable; every rank passes the same shapes in the same order.
        """
        if self.size == 1:
            return 0
        calls = 0
        for bucket in plan_buckets(arrays, self.fusion_bytes):
            if len(bucket) == 1:
                arr = arrays[bucket[0]]
                if not (arr.flags.c_contiguous and arr.flags.writeable):
                    raise ValueError("average_: arrays must be C-contiguous and writeable")
                self._allreduce_bucket(calls, arr)
            else:
                parts = [arrays[i] for i in bucket]
                flat = self._buffer(parts[0].dtype, sum(p.size for p in parts))
                offset = 0
                for p in parts:
                    flat[offset:offset + p.size] = p.reshape(-1)
                    offset += p.size
                self._allreduce_bucket(calls, flat)
                offset = 0
                for p in parts:
                    p.reshape(-1)[:] = flat[offset:offset + p.size]
                    offset += p.size
            calls += 1
        return calls

    def average_flat_(self, flat: np.ndarray, sizes: Sequence[int]) -> int:
        """Like `average_` for arrays already packed back to back in ``flat`` (``sizes`` elements each).

        Each bucket is a slice of ``flat`` and is reduced in place: no packing copies.
        """
        if self.size == 1:
            return 0
        offsets = np.cumsum([0, *sizes])
        if offsets[-1] != flat.size or not (flat.flags.c_contiguous and flat.flags.writeable):
            raise ValueError("average_flat_: flat must be C-contiguous, writeable and hold exactly sum(sizes) elements")
        parts = [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        buckets = plan_buckets(parts, self.fusion_bytes)  # one dtype: each bucket is a run of consecutive parts
        for index, bucket in enumerate(buckets):
            self._allreduce_bucket(index, flat[offsets[bucket[0]]:offsets[bucket[-1] + 1]])
        return len(buckets)

    def broadcast_(self, arrays: Sequence[np.ndarray], root: int = 0) -> None:
        """Overwrite each array with ``root``'s, in place (initial weights)."""
        if self.size == 1:
            return
        for arr in arrays:
            self.transport.bcast(arr, root)

    # ------------------------------------------------------------------ the Trainer's collectives
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        buf = np.array(values, dtype=np.float64, copy=True)
        if self.size > 1:
            self.transport.allreduce(buf, op)
        return buf

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.transport.bcast_object(obj, src) if self.size > 1 else obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.transport.allgather_object(obj) if self.size > 1 else [obj]

    def barrier(self) -> None:
        if self.size > 1:
            self.transport.barrier()


class TrainerCollectivesOverMpi:
    """The Trainer's collectives for a backend whose ``self.mpi`` is an `MpiCollectives` (torch and TF alike)."""

    mpi: MpiCollectives
    world: Any

    def progress_board(self) -> Any | None:
        """The stall watchdog's side channel (MPI cannot say which ranks have not reached a collective)."""
        from polytrain.observe.watchdog import hosted_store_board

        return hosted_store_board(self.world, self.mpi.broadcast_object)

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return self.mpi.all_reduce(values, op)

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        return ready(self.mpi.all_reduce(values, op))  # at once: the transport's collectives run in order

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.mpi.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.mpi.all_gather_object(obj)

    def barrier(self) -> None:
        self.mpi.barrier()

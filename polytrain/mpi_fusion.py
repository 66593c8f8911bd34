"""MPI collectives through mpi4py, framework-neutral: fused gradient averaging and the Trainer's collectives.

Gradients are averaged with ``MPI_Allreduce`` on contiguous numpy buffers. Small arrays
are packed into buckets of up to ``POLYTRAIN_MPI_FUSION_BYTES`` (default 64 MiB, Horovod's
fusion threshold) so a model with many small tensors costs a few collectives instead of
hundreds; an array larger than the threshold is reduced on its own, in place.
``POLYTRAIN_MPI_FUSION_BYTES=0`` turns fusion off (one collective per array).

mpi4py is imported only when an `MpiCollectives` is made: importing ``mpi4py.MPI``
initialises MPI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError
from polytrain.timeline import COLLECTIVES, NULL

DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
FUSION_ENV = "POLYTRAIN_MPI_FUSION_BYTES"


def fusion_threshold(env: Mapping[str, str] | None = None) -> int:
    """The bucket size in bytes from ``POLYTRAIN_MPI_FUSION_BYTES`` (default 64 MiB; 0 = no fusion)."""
    env = os.environ if env is None else env
    raw = env.get(FUSION_ENV, "").strip()
    if not raw:
        return DEFAULT_FUSION_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise EnvironmentDetectionError(
            f"{FUSION_ENV}={raw!r} is not an integer; it must be a number of bytes >= 0 (0 = no fusion)") from None
    if value < 0:
        raise EnvironmentDetectionError(f"{FUSION_ENV}={value} is negative; it must be a number of bytes >= 0")
    return value


def plan_buckets(arrays: Sequence[np.ndarray], threshold: int) -> list[list[int]]:
    """Group array indices into buckets: consecutive, one dtype, at most ``threshold`` bytes together.

    An array of ``threshold`` bytes or more (or any array when ``threshold`` is 0) is a bucket alone.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, arr in enumerate(arrays):
        nbytes = arr.nbytes
        if nbytes >= threshold or threshold == 0:
            if current:
                buckets.append(current)
                current, current_bytes = [], 0
            buckets.append([i])
            continue
        if current and (arr.dtype != arrays[current[0]].dtype or current_bytes + nbytes > threshold):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


class MpiCollectives:
    """``MPI_COMM_WORLD`` as a polytrain backend sees it: fused averaging, broadcast, Trainer collectives."""

    def __init__(self, expected_rank: int, expected_size: int, launcher: str,
                 fusion_bytes: int | None = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise BackendUnavailableError(f"backend: 'mpi' needs mpi4py ({exc}); pip install 'polytrain[mpi]'") from exc
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
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
        self.comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)
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
        buckets = plan_buckets(parts, self.fusion_bytes)
        for index, bucket in enumerate(buckets):
            self._allreduce_bucket(index, flat[offsets[bucket[0]]:offsets[bucket[-1] + 1]])
        return len(buckets)

    def broadcast_(self, arrays: Sequence[np.ndarray], root: int = 0) -> None:
        """Overwrite each array with ``root``'s, in place (initial weights)."""
        if self.size == 1:
            return
        for arr in arrays:
            self.comm.Bcast(arr, root=root)

    # ------------------------------------------------------------------ the Trainer's collectives
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        buf = np.array(values, dtype=np.float64, copy=True)
        if self.size > 1:
            mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        return buf

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.bcast(obj, root=src) if self.size > 1 else obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj) if self.size > 1 else [obj]

    def barrier(self) -> None:
        if self.size > 1:
            self.comm.Barrier()


class TrainerCollectivesOverMpi:
    """The Trainer's collectives for a backend whose ``self.mpi`` is an `MpiCollectives` (torch and TF alike)."""

    mpi: MpiCollectives
    world: Any

    def progress_board(self) -> Any | None:
        """The stall watchdog's side channel (MPI cannot say which ranks have not reached a collective)."""
        from polytrain.watchdog import hosted_store_board

        return hosted_store_board(self.world, self.mpi.broadcast_object)

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return self.mpi.all_reduce(values, op)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.mpi.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.mpi.all_gather_object(obj)

    def barrier(self) -> None:
        self.mpi.barrier()

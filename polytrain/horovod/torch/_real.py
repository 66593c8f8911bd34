"""The real Horovod's ``horovod.torch``, under the names ``polytrain.horovod.torch`` exports.

horovod.torch re-exports most of ``horovod.torch.mpi_ops``, not all of it (0.28.1 leaves out
``is_homogeneous``): each name comes from the first of the two that has it.
"""

from __future__ import annotations

import horovod.torch as _hvd
import horovod.torch.mpi_ops as _ops

from polytrain.horovod.common import resolve_names

IMPL = "horovod"
_SOURCES = (_hvd, _ops)

Adasum, Average, Max, Min, Product, Sum = resolve_names(_SOURCES, "Adasum", "Average", "Max", "Min", "Product", "Sum")
init, shutdown, is_initialized, start_timeline, stop_timeline = resolve_names(
    _SOURCES, "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline")
size, rank, local_size, local_rank, cross_size, cross_rank, is_homogeneous = resolve_names(
    _SOURCES, "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous")
mpi_built, mpi_enabled, mpi_threads_supported, gloo_built, gloo_enabled = resolve_names(
    _SOURCES, "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled")
nccl_built, ddl_built, ccl_built, cuda_built, rocm_built = resolve_names(
    _SOURCES, "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built")
ProcessSet, global_process_set, add_process_set, remove_process_set = resolve_names(
    _SOURCES, "ProcessSet", "global_process_set", "add_process_set", "remove_process_set")
allreduce_async, allreduce_async_, grouped_allreduce_async, grouped_allreduce_async_ = resolve_names(
    _SOURCES, "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_")
allgather_async, grouped_allgather_async, broadcast_async, broadcast_async_ = resolve_names(
    _SOURCES, "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_")
alltoall_async, reducescatter_async, grouped_reducescatter_async = resolve_names(
    _SOURCES, "alltoall_async", "reducescatter_async", "grouped_reducescatter_async")
poll, synchronize, barrier, join = resolve_names(_SOURCES, "poll", "synchronize", "barrier", "join")
allreduce, allreduce_, grouped_allreduce, grouped_allreduce_ = resolve_names(
    _SOURCES, "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_")
allgather, grouped_allgather, broadcast, broadcast_, alltoall = resolve_names(
    _SOURCES, "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall")
reducescatter, grouped_reducescatter, sparse_allreduce_async = resolve_names(
    _SOURCES, "reducescatter", "grouped_reducescatter", "sparse_allreduce_async")
allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters = resolve_names(
    _SOURCES, "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters")
DistributedOptimizer, Compression, SyncBatchNorm, HorovodInternalError, elastic = resolve_names(
    _SOURCES, "DistributedOptimizer", "Compression", "SyncBatchNorm", "HorovodInternalError", "elastic")

__all__ = [
    "IMPL", "Adasum", "Average", "Max", "Min", "Product", "Sum", "init", "shutdown", "is_initialized",
    "start_timeline", "stop_timeline", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
    "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "poll", "synchronize", "barrier", "join",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "sparse_allreduce_async",
    "allgather_object",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "DistributedOptimizer", "Compression",
    "SyncBatchNorm", "HorovodInternalError", "elastic",
]

"""The basics and raw collectives of the real Horovod (``horovod.tensorflow``), under the shim's names.

Horovod 0.28.1's TensorFlow ops (allreduce, allgather, broadcast, alltoall, reducescatter,
join) work on TensorFlow 2.21; its Keras and GradientTape wrappers do not, so polytrain builds
those on top of the functions here. Values are converted to tensors first, so Keras 3
variables are accepted.
"""

from __future__ import annotations

import horovod.tensorflow as _hvd
import tensorflow as tf
from horovod.tensorflow import mpi_ops as _ops

from polytrain.horovod import common

IMPL = "horovod"

init = _hvd.init
shutdown = _hvd.shutdown
is_initialized = _hvd.is_initialized
size, rank, local_size, local_rank = _hvd.size, _hvd.rank, _hvd.local_size, _hvd.local_rank
cross_size, cross_rank, is_homogeneous = _hvd.cross_size, _hvd.cross_rank, _hvd.is_homogeneous
mpi_threads_supported, mpi_enabled, mpi_built = _hvd.mpi_threads_supported, _hvd.mpi_enabled, _hvd.mpi_built
gloo_enabled, gloo_built, nccl_built = _hvd.gloo_enabled, _hvd.gloo_built, _hvd.nccl_built
ddl_built, ccl_built, cuda_built, rocm_built = _hvd.ddl_built, _hvd.ccl_built, _hvd.cuda_built, _hvd.rocm_built
start_timeline, stop_timeline = _hvd.start_timeline, _hvd.stop_timeline
ProcessSet, global_process_set = _hvd.ProcessSet, _hvd.global_process_set
add_process_set, remove_process_set = _hvd.add_process_set, _hvd.remove_process_set
size_op, rank_op, local_size_op, local_rank_op = _hvd.size_op, _hvd.rank_op, _hvd.local_size_op, _hvd.local_rank_op


def _tensor(value) -> tf.Tensor:
    return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)


def _per_dtype(fn, tensors) -> list[tf.Tensor]:
    """``fn`` on each same-dtype subset (Horovod's grouped ops take one dtype), results in input order."""
    tensors = [_tensor(t) for t in tensors]
    out: list = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        for i, result in zip(idx, fn([tensors[i] for i in idx])):
            out[i] = result
    return out


def allreduce(tensor, op=common.Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False) -> tf.Tensor:
    return _ops._allreduce(_tensor(tensor), name=name, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                           process_set=process_set)


def grouped_allreduce(tensors, op=common.Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set=global_process_set, ignore_name_scope=False) -> list[tf.Tensor]:
    return _per_dtype(lambda group: _ops._grouped_allreduce(
        group, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        ignore_name_scope=ignore_name_scope, process_set=process_set), tensors)


def allgather(tensor, name=None, process_set=global_process_set, ignore_name_scope=False) -> tf.Tensor:
    return _ops.allgather(_tensor(tensor), name=name, ignore_name_scope=ignore_name_scope,
                          process_set=process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set, ignore_name_scope=False):
    return _per_dtype(lambda group: _ops.grouped_allgather(
        group, name=name, ignore_name_scope=ignore_name_scope, process_set=process_set), tensors)


def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set,
              ignore_name_scope=False) -> tf.Tensor:
    return _ops.broadcast(_tensor(tensor), root_rank, name=name, ignore_name_scope=ignore_name_scope,
                          process_set=process_set)


def grouped_broadcast(tensors, root_rank: int, process_set=global_process_set) -> list[tf.Tensor]:
    return [broadcast(t, root_rank, process_set=process_set) for t in tensors]


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, ignore_name_scope=False):
    """(received tensor, received splits); an empty ``splits`` splits the first dimension evenly."""
    splits = tf.constant([], tf.int32) if splits is None else tf.cast(_tensor(splits), tf.int32)
    return _ops.alltoall(_tensor(tensor), splits=splits, name=name, ignore_name_scope=ignore_name_scope,
                         process_set=process_set)


def reducescatter(tensor, op=common.Sum, name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0) -> tf.Tensor:
    return _ops._reducescatter(_tensor(tensor), name=name, op=op, ignore_name_scope=ignore_name_scope,
                               process_set=process_set, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor)


def grouped_reducescatter(tensors, op=common.Sum, name=None, process_set=global_process_set,
                          ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    return _per_dtype(lambda group: _ops._grouped_reducescatter(
        group, name=name, op=op, ignore_name_scope=ignore_name_scope, process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor), tensors)


def join() -> tf.Tensor:
    return _ops.join()


def barrier(process_set=global_process_set) -> None:
    """Horovod's TensorFlow API has no barrier: a summed scalar is one."""
    _ops._allreduce(tf.constant(0, tf.int32), op=common.Sum, process_set=process_set).numpy()

__all__ = [
    "IMPL", "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
    "stop_timeline", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "size_op",
    "rank_op", "local_size_op", "local_rank_op", "allreduce", "grouped_allreduce", "allgather",
    "grouped_allgather", "broadcast", "grouped_broadcast", "alltoall", "reducescatter", "grouped_reducescatter",
    "join", "barrier",
]

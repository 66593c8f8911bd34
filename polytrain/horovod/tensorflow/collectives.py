"""Horovod's public TensorFlow collectives: reduce-op handling, compression, ``tf.IndexedSlices``.

Same names, signatures and results as Horovod 0.28.1 ``horovod/tensorflow/__init__.py`` and
``mpi_ops.py``; the transport underneath is ``_impl`` (real Horovod or polytrain's MPI
shim). A sparse gradient (``tf.IndexedSlices``) is reduced the way Horovod does it: its values
and indices are allgathered (divided by the size for ``Average``).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from polytrain.horovod.common import (
    REDUCE_OP_NAMES,
    Adasum,
    Average,
    HorovodArgumentError,
    HorovodUnsupportedError,
    Max,
    Min,
    Product,
    Sum,
    resolve_average,
)
from polytrain.horovod.tensorflow import _impl
from polytrain.horovod.tensorflow.compression import Compression

global_process_set = _impl.global_process_set


#: Horovod's public name for the op/average rule (shared with the torch API).
handle_average_backwards_compatibility = resolve_average


def _check_op(op, allowed=(Average, Sum, Min, Max, Product)) -> None:
    if op == Adasum:
        raise HorovodUnsupportedError("op=hvd.Adasum is not supported by polytrain (it needs Horovod's C++ "
                                      "engine); use hvd.Average or hvd.Sum")
    if op not in allowed:
        names = ", ".join(f"hvd.{REDUCE_OP_NAMES[a]}" for a in allowed)
        raise HorovodArgumentError(f"op={op!r} is not allowed here; use one of {names}")


def _on(device: str):
    return tf.device(device) if device else contextlib.nullcontext()


def _set_size(process_set) -> int:
    n = process_set.size()
    if n is None:
        raise HorovodArgumentError("the process set is not initialized; call hvd.init() first")
    return n


def _sparse_allreduce(values: list[tf.IndexedSlices], op, prescale_factor, postscale_factor,
                      device_sparse, process_set) -> list[tf.IndexedSlices]:
    if op not in (Sum, Average):
        raise HorovodUnsupportedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise HorovodUnsupportedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    n = _set_size(process_set)
    with _on(device_sparse):  # two grouped allgathers: Horovod's grouped ops need one dtype
        gathered_values = _impl.grouped_allgather([s.values for s in values], process_set=process_set)
        gathered_indices = _impl.grouped_allgather([s.indices for s in values], process_set=process_set)
    out = []
    for s, vals, idx in zip(values, gathered_values, gathered_indices):
        vals = vals / tf.cast(n, vals.dtype) if op == Average else vals
        out.append(tf.IndexedSlices(vals, idx, dense_shape=s.dense_shape))
    return out


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` over all processes (default: average); same shape and dtype as the input.

    For a ``tf.IndexedSlices`` the values and indices are allgathered instead (Sum/Average only).
    """
    op = resolve_average(op, average)
    if op == Adasum and _impl.IMPL == "horovod":
        import horovod.tensorflow as real

        return real.allreduce(tensor, device_dense=device_dense, device_sparse=device_sparse,
                              compression=compression, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, name=name, process_set=process_set)
    _check_op(op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce([tensor], op, prescale_factor, postscale_factor, device_sparse, process_set)[0]
    with _on(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = _impl.allreduce(compressed, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, name=name, process_set=process_set,
                                 ignore_name_scope=ignore_name_scope)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors (and ``tf.IndexedSlices``) together; a list in the same order."""
    if not tensors:
        return tensors
    op = resolve_average(op, average)
    _check_op(op)
    out: list = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        reduced = _sparse_allreduce([tensors[i] for i in sparse], op, prescale_factor, postscale_factor,
                                    device_sparse, process_set)
        for i, r in zip(sparse, reduced):
            out[i] = r
    if dense:
        with _on(device_dense):
            packed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
            reduced = _impl.grouped_allreduce([p[0] for p in packed], op=op, prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor, name=name,
                                             process_set=process_set, ignore_name_scope=ignore_name_scope)
            for i, r, (_, ctx) in zip(dense, reduced, packed):
                out[i] = compression.decompress(r, ctx)
    return out


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every process's ``tensor`` along the first dimension (which may differ per process)."""
    return _impl.allgather(tensor, name=name, process_set=process_set, ignore_name_scope=ignore_name_scope)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    return _impl.grouped_allgather(tensors, name=name, process_set=process_set,
                                  ignore_name_scope=ignore_name_scope)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``root_rank``'s value of ``tensor`` on every process."""
    return _impl.broadcast(tensor, root_rank, name=name, process_set=process_set,
                          ignore_name_scope=ignore_name_scope)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign ``root_rank``'s values to ``variables`` in place; the values as tensors."""
    values = _impl.grouped_broadcast(list(variables), root_rank, process_set=process_set)
    for var, value in zip(variables, values):
        var.assign(value)
    return values


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[r]`` rows to rank r (equal parts without ``splits``); with ``splits`` also the
    received splits, as Horovod returns."""
    out, received = _impl.alltoall(tensor, splits=splits, name=name, process_set=process_set,
                                  ignore_name_scope=ignore_name_scope)
    return (out, received) if splits is not None else out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce, then keep this rank's block of rows (the first ``rows % size`` ranks get one more)."""
    _check_op(op, (Average, Sum))
    with _on(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = _impl.reducescatter(compressed, op=op, name=name, process_set=process_set,
                                     ignore_name_scope=ignore_name_scope, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    if not tensors:
        return tensors
    _check_op(op, (Average, Sum))
    with _on(device_dense):
        packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        reduced = _impl.grouped_reducescatter([p[0] for p in packed], op=op, process_set=process_set,
                                             prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


def join():
    """This rank has no more data: contribute zeros to the others' allreduces until all joined.

    Returns the last rank that joined (a scalar int32 tensor).
    """
    return _impl.join()


def barrier(process_set=global_process_set) -> None:
    """Wait until every process arrives (Horovod's TensorFlow API lacks it; its PyTorch API has it)."""
    _impl.barrier(process_set=process_set)

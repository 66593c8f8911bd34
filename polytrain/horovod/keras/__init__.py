"""Horovod's Keras API for Keras 3 on TensorFlow (``import polytrain.horovod.keras as hvd``).

Also reachable as ``polytrain.horovod.tensorflow.keras``, like Horovod's layout. The
basics and collectives are ``polytrain.horovod.tensorflow``'s (real Horovod's when it is
installed); ``DistributedOptimizer`` (``polytrain.horovod.tensorflow.optimizer``) and the
callbacks, ``PartialDistributedOptimizer`` and ``elastic`` (`polytrain.horovod.keras.elastic`) are
polytrain's, for Keras 3.
"""

from __future__ import annotations

import keras
import tensorflow as tf

import polytrain.horovod.tensorflow as _tf
from polytrain.horovod.keras import callbacks, elastic
from polytrain.horovod.tensorflow import Average, Compression, HorovodUnsupportedError, Sum, collectives
from polytrain.horovod.tensorflow.optimizer import DistributedOptimizer, PartialDistributedOptimizer

# The basics are polytrain.horovod.tensorflow's, whichever implementation runs it.
IMPL = _tf.IMPL
init, shutdown, is_initialized = _tf.init, _tf.shutdown, _tf.is_initialized
size, rank, local_size, local_rank, cross_size, cross_rank, is_homogeneous = (
    _tf.size, _tf.rank, _tf.local_size, _tf.local_rank, _tf.cross_size, _tf.cross_rank, _tf.is_homogeneous)
mpi_built, gloo_built, nccl_built, ddl_built, ccl_built, cuda_built, rocm_built = (
    _tf.mpi_built, _tf.gloo_built, _tf.nccl_built, _tf.ddl_built, _tf.ccl_built, _tf.cuda_built, _tf.rocm_built)
mpi_enabled, mpi_threads_supported, gloo_enabled = _tf.mpi_enabled, _tf.mpi_threads_supported, _tf.gloo_enabled
start_timeline, stop_timeline = _tf.start_timeline, _tf.stop_timeline
ProcessSet, global_process_set, add_process_set, remove_process_set = (
    _tf.ProcessSet, _tf.global_process_set, _tf.add_process_set, _tf.remove_process_set)


def broadcast_global_variables(root_rank):
    """TF1 graph-mode only in Horovod; Keras 3 has no global variable collection."""
    raise HorovodUnsupportedError("broadcast_global_variables needs TF1 graph mode; use "
                                  "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                                  "polytrain.horovod.tensorflow.broadcast_variables(model.weights, root_rank)")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce a tensor-compatible value over all processes (default: average); a tensor."""
    return collectives.allreduce(tf.constant(value, name=name), average=average, compression=compression, op=op,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allgather(value, name=None):
    """Concatenate a tensor-compatible value from every process along the first dimension."""
    return collectives.allgather(tf.constant(value, name=name))


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every process."""
    return collectives.broadcast(tf.constant(value, name=name), root_rank)


def reducescatter(value, name=None, op=Average):
    """Reduce a value over all processes and keep this process's block of rows."""
    return collectives.reducescatter(tf.constant(value, name=name), op=op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Load a saved Keras model; its optimizer comes back wrapped in `DistributedOptimizer`.

    Models saved with or without a `DistributedOptimizer` load alike; optimizer state is kept.
    """
    objects = {"DistributedOptimizer": DistributedOptimizer}
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model


__all__ = [
    "IMPL", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "ProcessSet", "Sum",
    "add_process_set", "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks", "ccl_built",
    "cross_rank", "cross_size", "elastic",
    "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
    "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline",
]

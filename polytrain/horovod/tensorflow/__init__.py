"""Horovod's TensorFlow API (``import polytrain.horovod.tensorflow as hvd``) for TensorFlow 2.21 / Keras 3.

With real Horovod importable (``POLYTRAIN_HOROVOD_IMPL=auto|horovod``) the basics and raw
collectives are Horovod's; without it they run on MPI through mpi4py (under mpirun, srun or
``horovodrun --mpi``), or trivially in a single process (``_impl`` chooses, once, between
``_real`` and ``_shim``; both export the same names). ``DistributedGradientTape``,
``DistributedOptimizer`` and the Keras callbacks are always polytrain's: Horovod 0.28.1's own
fail on Keras 3 variables. Keras lives in ``polytrain.horovod.tensorflow.keras`` (the same
module as ``polytrain.horovod.keras``); Horovod's helpers in ``util`` (``hvd.util._executing_eagerly()``).
"""

from __future__ import annotations

from polytrain.horovod.common import Adasum, Average, Max, Min, Product, Sum
from polytrain.horovod.common.errors import HorovodArgumentError, HorovodUnsupportedError
from polytrain.horovod.tensorflow import elastic, util
from polytrain.horovod.tensorflow._impl import (
    IMPL,
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rank_op,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from polytrain.horovod.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    handle_average_backwards_compatibility,
    join,
    reducescatter,
)
from polytrain.horovod.tensorflow.compression import Compression
from polytrain.horovod.tensorflow.functions import allgather_object, broadcast_object, broadcast_variables
from polytrain.horovod.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape


def broadcast_global_variables(root_rank):
    """TF1 graph mode only in Horovod; TensorFlow 2 code broadcasts the variables it has."""
    raise HorovodUnsupportedError("broadcast_global_variables needs TF1 graph mode; use "
                                  "hvd.broadcast_variables(model.variables, root_rank)")


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so its gradients are averaged (`optimizer.DistributedOptimizer`, which
    ``polytrain.horovod.keras`` exports).

    TF1 ``tf.compat.v1.train.Optimizer`` graphs are not supported.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HorovodUnsupportedError(f"DistributedOptimizer wraps Keras 3 optimizers; got "
                                      f"{type(optimizer).__name__} (TF1 optimizers need legacy Horovod)")
    from polytrain.horovod.tensorflow.optimizer import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


__all__ = [
    "IMPL", "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "HorovodArgumentError", "HorovodUnsupportedError", "Max", "Min", "PartialDistributedGradientTape",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall",
    "barrier", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_variables", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rank_op",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline", "util",
]

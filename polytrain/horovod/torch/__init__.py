"""``import polytrain.horovod.torch as hvd``: Horovod's PyTorch API.

When the real ``horovod.torch`` imports (and ``POLYTRAIN_HOROVOD_IMPL`` is not ``shim``)
these names are Horovod's own; otherwise they are polytrain's implementation on
torch.distributed (gloo, NCCL for CUDA tensors). ``IMPL`` tells which one is active.
Differences of the shim, all documented where they live: ops must be submitted in the
same order on every rank (a different order is a reported mismatch), Adasum is refused,
process sets must be added/removed by every rank, and the timeline (HOROVOD_TIMELINE,
``start_timeline``) records each op from submission to completion as a Chrome trace, one
process track per rank, not Horovod's per-tensor negotiation phases.
"""

from polytrain.horovod.common import use_real_horovod as _use_real_horovod

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]

if _use_real_horovod("torch"):
    import horovod.torch as _real
    import horovod.torch.mpi_ops as _real_ops  # holds a few names horovod.torch does not re-export

    globals().update({name: getattr(_real, name, None) or getattr(_real_ops, name) for name in __all__
                      if hasattr(_real, name) or hasattr(_real_ops, name)})
    IMPL = "horovod"
else:
    from polytrain.horovod.common import Adasum, Average, Max, Min, Product, Sum
    from polytrain.horovod.torch import elastic
    from polytrain.horovod.torch.basics import (
        HorovodInternalError,
        ccl_built,
        cross_rank,
        cross_size,
        cuda_built,
        ddl_built,
        gloo_built,
        gloo_enabled,
        init,
        is_homogeneous,
        is_initialized,
        local_rank,
        local_size,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        nccl_built,
        rank,
        rocm_built,
        shutdown,
        size,
        start_timeline,
        stop_timeline,
    )
    from polytrain.horovod.torch.collectives import (
        allgather_async,
        allreduce_async,
        allreduce_async_,
        alltoall_async,
        barrier,
        broadcast_async,
        broadcast_async_,
        grouped_allgather_async,
        grouped_allreduce_async,
        grouped_allreduce_async_,
        grouped_reducescatter_async,
        poll,
        reducescatter_async,
        synchronize,
    )
    from polytrain.horovod.torch.compression import Compression
    from polytrain.horovod.torch.functions import (
        allgather_object,
        broadcast_object,
        broadcast_optimizer_state,
        broadcast_parameters,
    )
    from polytrain.horovod.torch.join import join
    from polytrain.horovod.torch.ops import (
        allgather,
        allreduce,
        allreduce_,
        alltoall,
        broadcast,
        broadcast_,
        grouped_allgather,
        grouped_allreduce,
        grouped_allreduce_,
        grouped_reducescatter,
        reducescatter,
    )
    from polytrain.horovod.torch.optimizer import DistributedOptimizer
    from polytrain.horovod.torch.process_sets import (
        ProcessSet,
        add_process_set,
        global_process_set,
        remove_process_set,
    )
    from polytrain.horovod.torch.sync_batch_norm import SyncBatchNorm

    IMPL = "polytrain"

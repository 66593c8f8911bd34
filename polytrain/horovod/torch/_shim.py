"""polytrain's implementation of ``horovod.torch``, on torch.distributed (and MPI under an MPI launcher).

What ``polytrain.horovod.torch`` runs without real Horovod (see ``_impl``): `basics` starts
the job, `collectives` runs each op asynchronously behind an int handle, `ops` makes the
synchronous ones differentiable, `optimizer` overlaps gradient buckets with backward. Each
module's ``__all__`` says which of its names belong to Horovod's API.
"""

from polytrain.horovod.common import Adasum, Average, HorovodInternalError, Max, Min, Product, Sum
from polytrain.horovod.torch import basics, collectives, elastic, functions, ops, process_sets, scatter
from polytrain.horovod.torch.basics import *  # noqa: F403
from polytrain.horovod.torch.collectives import *  # noqa: F403
from polytrain.horovod.torch.compression import Compression
from polytrain.horovod.torch.functions import *  # noqa: F403
from polytrain.horovod.torch.join import join
from polytrain.horovod.torch.ops import *  # noqa: F403
from polytrain.horovod.torch.optimizer import DistributedOptimizer
from polytrain.horovod.torch.process_sets import *  # noqa: F403
from polytrain.horovod.torch.scatter import *  # noqa: F403
from polytrain.horovod.torch.sync_batch_norm import SyncBatchNorm

IMPL = "polytrain"

__all__ = [
    "IMPL", "Adasum", "Average", "Max", "Min", "Product", "Sum", "HorovodInternalError", "Compression", "join",
    "DistributedOptimizer", "SyncBatchNorm", "elastic", *basics.__all__, *collectives.__all__, *ops.__all__,
    *functions.__all__, *process_sets.__all__, *scatter.__all__,
]

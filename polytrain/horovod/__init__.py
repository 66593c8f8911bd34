"""The Horovod-compatible API: ``polytrain.horovod.torch``, ``.tensorflow``, ``.keras``.

A Horovod script changes one line (``import horovod.torch as hvd`` becomes
``import polytrain.horovod.torch as hvd``) and keeps working: each framework module
re-exports the real ``horovod`` package when it imports (``POLYTRAIN_HOROVOD_IMPL=auto``,
the default), and otherwise runs the same API on the framework's own collectives.
``POLYTRAIN_HOROVOD_IMPL=shim`` forces polytrain's implementation, ``horovod`` requires
the real one. Shared constants and settings live in `polytrain.horovod.common`.
"""

from polytrain.comm.mpi_singleton import keep_singletons_off_shared_memory
from polytrain.horovod.common import (
    Adasum,
    Average,
    HorovodSettings,
    Max,
    Min,
    Product,
    Sum,
    use_real_horovod,
)

keep_singletons_off_shared_memory()  # before Horovod or mpi4py starts MPI (see polytrain.comm.mpi_singleton)

__all__ = ["Adasum", "Average", "HorovodSettings", "Max", "Min", "Product", "Sum", "use_real_horovod"]

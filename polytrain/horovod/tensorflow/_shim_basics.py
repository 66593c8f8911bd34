"""polytrain's own Horovod basics: start MPI (or nothing, for one process) and report the topology.

The ranks come from MPI's world communicator; local and cross ranks from the launcher's
environment (``polytrain.environments.detect_world``), exchanged once so every rank knows every
rank's node (``polytrain.horovod.common.topology_from_records``).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from polytrain.errors import BackendUnavailableError
from polytrain.horovod import common
from polytrain.horovod.tensorflow import _engine
from polytrain.horovod.tensorflow._errors import HorovodUnsupportedError
from polytrain.horovod.tensorflow._process_sets import global_process_set

IMPL = "polytrain"
_state: dict = {}


def _open_transport(comm) -> tuple:
    from polytrain.environments import environment_for
    from polytrain.environments import detect_world

    world = detect_world()
    launcher = environment_for(os.environ)
    if comm is None and world.size == 1 and not launcher.speaks_mpi:
        return _engine.LocalTransport(), world  # one process and no MPI launcher: nothing to start
    if comm is None and not (launcher.speaks_mpi or launcher.launcher == "slurm"):
        raise BackendUnavailableError(
            f"polytrain.horovod.tensorflow without Horovod runs its collectives on MPI, but this job was "
            f"started by {world.launcher} ({world.size} processes); launch it with mpirun/srun/horovodrun "
            "--mpi, or install Horovod with TensorFlow support (scripts/build_horovod.sh)")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        if comm is None and world.size == 1:
            return _engine.LocalTransport(), world
        raise BackendUnavailableError(f"polytrain.horovod.tensorflow without Horovod needs mpi4py ({exc}); "
                                      "pip install mpi4py, or install Horovod with TensorFlow support") from None
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm is MPI.COMM_WORLD and comm.Get_size() != world.size:
        raise BackendUnavailableError(
            f"MPI sees {comm.Get_size()} processes but {world.launcher} started {world.size}; mpi4py must "
            "bind to the MPI of the launcher (check which mpirun and libmpi are used)")
    settings = common.HorovodSettings.from_env()
    stall = settings.stall_check_seconds if settings.stall_check else None
    return _engine.MpiTransport(comm, stall_seconds=stall, shutdown_seconds=settings.shutdown_after), world


def init(comm=None, process_sets=None) -> None:
    """Start collectives: on ``comm`` (an mpi4py communicator), else MPI's world, else one process."""
    if _state:
        return
    ranks = None
    if comm is not None and not hasattr(comm, "Get_rank"):  # Horovod also takes a list of ranks
        ranks, comm = sorted(int(r) for r in comm), None
    if process_sets not in (None, [], "dynamic"):
        raise HorovodUnsupportedError("process sets other than the global one need real Horovod")
    settings = common.HorovodSettings.from_env()
    transport, world = _open_transport(comm)
    if ranks is not None and ranks != list(range(transport.size)):
        raise HorovodUnsupportedError(f"hvd.init(comm={ranks}): polytrain's Horovod shim runs on all "
                                      f"{transport.size} ranks; pass all of them, an mpi4py communicator, or nothing")
    records = [(world.node_rank, world.local_rank, world.local_size)]
    engine = _engine.Engine(transport, fusion_threshold=settings.fusion_threshold,
                            check_metadata=settings.metadata_check)
    if transport.size > 1 and comm is None:
        records = engine.allgather(np.array(records, np.int64))[0].tolist()
    elif transport.size > 1:  # a user communicator: ask MPI which of its ranks share a node
        records = _node_records(transport.comm).tolist()
    topo = common.topology_from_records(records, transport.rank)
    _state.update(engine=engine, topology=topo, world=world,
                  mpi=isinstance(transport, _engine.MpiTransport))
    global_process_set.ranks = list(range(topo.size))


def _node_records(comm) -> np.ndarray:
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leaders = comm.allgather(comm.Get_rank() if local.Get_rank() == 0 else -1)
    node = sorted(r for r in leaders if r >= 0).index(local.bcast(comm.Get_rank(), root=0))
    rec = comm.allgather((node, local.Get_rank(), local.Get_size()))
    local.Free()
    return np.array(rec, dtype=np.int64)


def shutdown() -> None:
    _state.clear()


def is_initialized() -> bool:
    return bool(_state)


def _topology() -> common.Topology:
    if not _state:
        raise ValueError(common.NOT_INITIALIZED)
    return _state["topology"]


def engine() -> _engine.Engine:
    if not _state:
        raise ValueError(common.NOT_INITIALIZED)
    return _state["engine"]


def size() -> int:
    return _topology().size


def rank() -> int:
    return _topology().rank


def local_size() -> int:
    return _topology().local_size


def local_rank() -> int:
    return _topology().local_rank


def cross_size() -> int:
    return _topology().cross_size


def cross_rank() -> int:
    return _topology().cross_rank


def is_homogeneous() -> bool:
    return _topology().is_homogeneous


def mpi_built() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    return bool(_state.get("mpi"))


def mpi_threads_supported() -> bool:
    if not mpi_enabled():
        raise ValueError(common.NOT_INITIALIZED if not _state else "MPI is not in use in this job")
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    return False


ddl_built = ccl_built = cuda_built = rocm_built = nccl_built


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise HorovodUnsupportedError("the Horovod timeline is not recorded by polytrain's shim")


def stop_timeline() -> None:
    raise HorovodUnsupportedError("the Horovod timeline is not recorded by polytrain's shim")


def size_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    return tf.constant(size(), dtype=tf.int32, name=name)


def local_size_op(name=None) -> tf.Tensor:
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def rank_op(name=None) -> tf.Tensor:
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_rank_op(name=None) -> tf.Tensor:
    return tf.constant(local_rank(), dtype=tf.int32, name=name)



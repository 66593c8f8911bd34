"""polytrain's own Horovod basics: start MPI (or nothing, for one process) and report the topology.

The ranks come from MPI's world communicator; local and cross ranks from the launcher's
environment (``polytrain.environments.detect_world``), exchanged once so every rank knows every
rank's node (``polytrain.horovod.common.topology_from_records``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.comm.mpi_transport import MpiTransport, mpi_installed
from polytrain.errors import BackendUnavailableError
from polytrain.horovod.common import HorovodSettings, HorovodUnsupportedError, topology_from_records
from polytrain.horovod.tensorflow.engine import Engine, LocalTransport
from polytrain.horovod.tensorflow.process_sets import register_global
from polytrain.horovod.tensorflow.runtime import Runtime
from polytrain.horovod.tensorflow.runtime import basics as _basics
from polytrain.world import World

is_initialized, size, rank, local_size = _basics.is_initialized, _basics.size, _basics.rank, _basics.local_size
local_rank, cross_size, cross_rank, is_homogeneous = (_basics.local_rank, _basics.cross_size, _basics.cross_rank,
                                                      _basics.is_homogeneous)
mpi_built = mpi_installed


def _open_transport(comm: Any) -> tuple[Any, World]:
    from polytrain.environments import detect_world, environment_for

    world = detect_world()
    launcher = environment_for(os.environ)
    if comm is None and world.size == 1 and not launcher.speaks_mpi:
        return LocalTransport(), world  # one process and no MPI launcher: nothing to start
    if comm is None and not (launcher.speaks_mpi or launcher.launcher == "slurm"):
        raise BackendUnavailableError(
            f"polytrain.horovod.tensorflow without Horovod runs its collectives on MPI, but this job was "
            f"started by {world.launcher} ({world.size} processes); launch it with mpirun/srun/horovodrun "
            "--mpi, or install Horovod with TensorFlow support (scripts/build_horovod.sh)")
    try:
        transport = MpiTransport(comm)
    except ImportError as exc:
        if comm is None and world.size == 1:
            return LocalTransport(), world
        raise BackendUnavailableError(f"polytrain.horovod.tensorflow without Horovod needs mpi4py ({exc}); "
                                      "pip install mpi4py, or install Horovod with TensorFlow support") from None
    if (comm is None or comm is transport.MPI.COMM_WORLD) and transport.size != world.size:
        raise BackendUnavailableError(
            f"MPI sees {transport.size} processes but {world.launcher} started {world.size}; mpi4py must "
            "bind to the MPI of the launcher (check which mpirun and libmpi are used)")
    return transport, world


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start collectives: on ``comm`` (an mpi4py communicator), else MPI's world, else one process."""
    if _basics.current is not None:
        return
    ranks = None
    if comm is not None and not hasattr(comm, "Get_rank"):  # Horovod also takes a list of ranks
        ranks, comm = sorted(int(r) for r in comm), None
    if process_sets not in (None, [], "dynamic"):
        raise HorovodUnsupportedError("process sets other than the global one need real Horovod")
    settings = HorovodSettings.from_env()
    transport, world = _open_transport(comm)
    if ranks is not None and ranks != list(range(transport.size)):
        raise HorovodUnsupportedError(f"hvd.init(comm={ranks}): polytrain's Horovod shim runs on all "
                                      f"{transport.size} ranks; pass all of them, an mpi4py communicator, or nothing")
    records = [(world.node_rank, world.local_rank, world.local_size)]
    engine = Engine(transport, fusion_threshold=settings.fusion_threshold, check_metadata=settings.metadata_check,
                    stall_seconds=settings.stall_check_seconds if settings.stall_check else None,
                    shutdown_seconds=settings.shutdown_after)
    if transport.size > 1 and comm is None:
        records = engine.allgather(np.array(records, np.int64))[0].tolist()
    elif transport.size > 1:  # a user communicator: ask MPI which of its ranks share a node
        records = transport.node_records()
    topology = topology_from_records(records, transport.rank)
    _basics.current = Runtime(engine=engine, topology=topology, world=world,
                              mpi=isinstance(transport, MpiTransport))
    register_global(topology)


def shutdown() -> None:
    _basics.current = None
    register_global(None)


def mpi_enabled() -> bool:
    return _basics.current is not None and _basics.current.mpi


def mpi_threads_supported() -> bool:
    if not mpi_enabled():
        _basics.state()  # Horovod's error when hvd.init() has not run
        raise ValueError("MPI is not in use in this job")
    return _basics.state().engine.t.thread_multiple()


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


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(size(), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "size_op", "rank", "rank_op", "local_size", "local_size_op",
    "local_rank", "local_rank_op", "cross_size", "cross_rank", "is_homogeneous", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
]

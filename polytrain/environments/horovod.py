"""``horovodrun`` in its two modes (as Horovod 0.28.1's ``horovod/runner`` sets them).

Gloo mode starts each worker itself and exports HOROVOD_RANK/SIZE/LOCAL_*/CROSS_* and
HOSTNAME, plus HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT (its HTTP rendezvous server — not a
torch master), HOROVOD_CONTROLLER=gloo and HOROVOD_CPU_OPERATIONS=gloo.

MPI mode runs ``mpirun -x <every exported variable>``: the ranks see the MPI family's own
variables. horovodrun adds no HOROVOD_* variable of its own there; it exports the tuning
variables only for flags given (``--fusion-threshold-mb`` → HOROVOD_FUSION_THRESHOLD ...)
and passes Open MPI ``-mca pml ob1 -mca btl ^openib`` with ``-x NCCL_SOCKET_IFNAME``.
Either of those marks a horovodrun-mpi job; without them it is indistinguishable from
the plain mpirun it really is.
"""

from __future__ import annotations

import dataclasses

from polytrain.environments.base import Env, Environment, read_addr, read_nodes, read_port, read_ranks
from polytrain.environments.lsf import LsfEnvironment
from polytrain.environments.mpi import (
    IntelMpiEnvironment,
    MpichEnvironment,
    MvapichEnvironment,
    OpenMpiEnvironment,
)
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

#: Variables horovodrun exports from its flags/config file (horovod/runner/common/util/config_parser.py).
HOROVODRUN_KNOBS = frozenset({
    "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES",
    "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_CCL_BGT_AFFINITY",
    "HOROVOD_GLOO_TIMEOUT_SECONDS", "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME",
})

_MPI_FAMILIES: tuple[type[Environment], ...] = (
    LsfEnvironment, OpenMpiEnvironment, MvapichEnvironment, IntelMpiEnvironment, MpichEnvironment)


def _has_horovodrun_marks(env: Env) -> bool:
    if any(k in env for k in HOROVODRUN_KNOBS):
        return True
    return env.get("OMPI_MCA_pml") == "ob1" and env.get("OMPI_MCA_btl") == "^openib" and "NCCL_SOCKET_IFNAME" in env


class HorovodGlooEnvironment(Environment):
    launcher = "horovodrun-gloo"

    @classmethod
    def detect(cls, env: Env) -> bool:
        gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or env.get("HOROVOD_CONTROLLER") == "gloo"
        return gloo and "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env

    @classmethod
    def world(cls, env: Env) -> World:
        rank, size, local_rank, local_size = read_ranks(
            env, "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")
        node_rank, num_nodes = read_nodes(env, "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", size)
        addr = read_addr(env) or read_addr(env, "HOROVOD_GLOO_RENDEZVOUS_ADDR")
        return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, node_rank=node_rank,
                     num_nodes=num_nodes, master_addr=addr, master_port=read_port(env), launcher=cls.launcher)


class HorovodMpiEnvironment(Environment):
    launcher = "horovodrun-mpi"
    speaks_mpi = True

    @classmethod
    def _family(cls, env: Env) -> type[Environment] | None:
        return next((family for family in _MPI_FAMILIES if family.detect(env)), None)

    @classmethod
    def detect(cls, env: Env) -> bool:
        return _has_horovodrun_marks(env) and cls._family(env) is not None

    @classmethod
    def world(cls, env: Env) -> World:
        family = cls._family(env)
        if family is None:
            raise EnvironmentDetectionError(
                "no MPI rank variables (OMPI_COMM_WORLD_RANK, PMI_RANK, MV2_COMM_WORLD_RANK, JSM_NAMESPACE_RANK); "
                "horovodrun-mpi workers must be started by mpirun or jsrun")
        return dataclasses.replace(family.world(env), launcher=cls.launcher)

"""Processes started by an MPI ``mpirun``/``mpiexec``: Open MPI, MPICH / Intel MPI, MVAPICH.

MPI launchers tell rank, size and the processes on this node, but neither a node index
nor a rendezvous address for non-MPI collectives. The node index is guessed here assuming
ranks fill nodes in order (Open MPI's default; not Hydra's round-robin ``-hosts``), and
``polytrain.environments.ensure_master`` makes it exact from the ranks' host names when the
job spans nodes. MASTER_ADDR/MASTER_PORT are used when the user exported them, otherwise
the port stays None and ``ensure_master`` agrees on one over MPI.
"""

from __future__ import annotations

from polytrain.environments.base import (
    Env,
    Environment,
    nodes_from_local,
    read_addr,
    read_int,
    read_port,
    read_ranks,
)
from polytrain.environments.slurm import SlurmEnvironment
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World


def mpi_world(env: Env, launcher: str, rank: str, size: str, local_rank: str, local_size: str,
              num_nodes: str | None = None) -> World:
    r, n, lr, ln = read_ranks(env, rank, size, local_rank, local_size)
    node_rank, nodes = nodes_from_local(r, n, ln)
    if num_nodes and num_nodes in env:
        nodes = read_int(env, num_nodes, minimum=1)
        if nodes > n:
            raise EnvironmentDetectionError(f"{num_nodes}={nodes} is more nodes than {size}={n}; it must be in 1..{n}")
        node_rank = min(node_rank, nodes - 1)
    addr = read_addr(env)
    if addr is None and ln == n:
        addr = "127.0.0.1"  # every process is on this node
    return World(rank=r, size=n, local_rank=lr, local_size=ln, node_rank=node_rank, num_nodes=nodes,
                 master_addr=addr, master_port=read_port(env), launcher=launcher)


class OpenMpiEnvironment(Environment):
    """Open MPI 4/5 ``mpirun`` (and PRRTE ``prterun``).

    OMPI_COMM_WORLD_NODE_RANK is deliberately not read: despite its name it is this
    process's rank among the processes on its node, not the node's index.
    """

    launcher = "openmpi"
    speaks_mpi = True

    @classmethod
    def detect(cls, env: Env) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env

    @classmethod
    def world(cls, env: Env) -> World:
        return mpi_world(env, cls.launcher, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         num_nodes="OMPI_MCA_orte_num_nodes")


class MvapichEnvironment(Environment):
    """MVAPICH2 ``mpirun_rsh``/``mpiexec`` (checked before MPICH: it may set PMI_* too)."""

    launcher = "mvapich"
    speaks_mpi = True

    @classmethod
    def detect(cls, env: Env) -> bool:
        return "MV2_COMM_WORLD_RANK" in env and "MV2_COMM_WORLD_SIZE" in env

    @classmethod
    def world(cls, env: Env) -> World:
        return mpi_world(env, cls.launcher, "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                         "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")


class MpichEnvironment(Environment):
    """MPICH's hydra ``mpiexec``: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.

    ``srun --mpi=pmi2`` also exports PMI_RANK/PMI_SIZE but no hydra local ids; inside
    such a Slurm step the Slurm variables are the richer source, so it is left to Slurm.
    """

    launcher = "mpich"
    speaks_mpi = True

    @classmethod
    def detect(cls, env: Env) -> bool:
        if "PMI_RANK" not in env or "PMI_SIZE" not in env:
            return False
        return "MPI_LOCALRANKID" in env or not SlurmEnvironment.detect(env)

    @classmethod
    def world(cls, env: Env) -> World:
        if "MPI_LOCALRANKID" in env:
            return mpi_world(env, cls.launcher, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        # no local ids (e.g. the gforker launcher): every process is taken to be on this node
        r, n, _, _ = read_ranks(env, "PMI_RANK", "PMI_SIZE")
        return World(rank=r, size=n, local_rank=r, local_size=n, master_addr=read_addr(env) or "127.0.0.1",
                     master_port=read_port(env), launcher=cls.launcher)


class IntelMpiEnvironment(MpichEnvironment):
    """Intel MPI: MPICH's variables plus its own I_MPI_* settings."""

    launcher = "intelmpi"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return super().detect(env) and any(k.startswith("I_MPI_") for k in env)

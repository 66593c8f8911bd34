"""IBM LSF's ``jsrun`` (Summit, Sierra, Lassen and other CORAL-style machines).

jsrun exports JSM_NAMESPACE_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; the job's hosts come from
LSB_MCPU_HOSTS (``"host slots host slots ..."``) or LSB_HOSTS (one name per slot). On
jsrun machines the first listed host is the batch/launch node, which runs no ranks, so
the master is the first host after it. With Spectrum MPI, jsrun also exports
OMPI_COMM_WORLD_*; JSM_NAMESPACE_* appear only under jsrun, so LSF is checked first.
"""

from __future__ import annotations

from polytrain.environments.base import (
    Env,
    Environment,
    nodes_from_local,
    port_from_job_id,
    read_addr,
    read_port,
    read_ranks,
)
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World


def compute_hosts(env: Env) -> list[str]:
    """The job's hosts in order, without the launch node (empty when LSF lists none)."""
    if env.get("LSB_MCPU_HOSTS", "").strip():
        fields = env["LSB_MCPU_HOSTS"].split()
        if len(fields) % 2 or not all(f.isdigit() for f in fields[1::2]):
            raise EnvironmentDetectionError(
                f"LSB_MCPU_HOSTS={env['LSB_MCPU_HOSTS']!r} is malformed; expected 'host slots host slots ...'")
        hosts = fields[0::2]
    else:
        hosts = list(dict.fromkeys(env.get("LSB_HOSTS", "").split()))
    return hosts[1:] if len(hosts) > 1 else hosts


class LsfEnvironment(Environment):
    launcher = "lsf"
    speaks_mpi = True

    @classmethod
    def detect(cls, env: Env) -> bool:
        return "JSM_NAMESPACE_RANK" in env and "JSM_NAMESPACE_SIZE" in env

    @classmethod
    def world(cls, env: Env) -> World:
        rank, size, local_rank, local_size = read_ranks(
            env, "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")
        hosts = compute_hosts(env)
        node_rank, num_nodes = nodes_from_local(rank, size, local_size)
        if size % local_size and hosts:
            num_nodes = len(hosts)
            node_rank = min(node_rank, num_nodes - 1)
        addr = read_addr(env) or (hosts[0] if hosts else None)
        port = read_port(env) or port_from_job_id(env, "LSB_JOBID")
        return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, node_rank=node_rank,
                     num_nodes=num_nodes, master_addr=addr, master_port=port, launcher=cls.launcher)

"""A worker of polytrain's elastic driver (`polytrain.launchers.elastic`).

The driver exports ``POLYTRAIN_ELASTIC_STORE``/``POLYTRAIN_ELASTIC_SLOT``/``POLYTRAIN_ELASTIC_VERSION`` and
Horovod's slot variables (``HOROVOD_RANK``/``SIZE``/``LOCAL_*``/``CROSS_*``, ``HOROVOD_ELASTIC=1``) of the
membership version the worker was spawned for. Its World is that assignment; the master is the driver's store
(a worker forms each version's group there: `polytrain.adapters.torch.reform`). Later versions are read from
the store (`polytrain.comm.membership`): a worker's environment is never rewritten.

First in ``PRECEDENCE``: the variables look like horovodrun's gloo mode too, and a driver may itself run
inside Slurm or an mpirun allocation.
"""

from __future__ import annotations

from polytrain.comm.membership import (
    SLOT_VARIABLE,
    STORE_VARIABLE,
    VERSION_VARIABLE,
    is_elastic,
    split_address,
)
from polytrain.environments.base import Env, Environment, read_int, read_nodes, read_ranks
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World


class ElasticEnvironment(Environment):
    launcher = "polytrain-elastic"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return is_elastic(env)

    @classmethod
    def world(cls, env: Env) -> World:
        read_int(env, VERSION_VARIABLE, default=0)
        if ":" not in env[SLOT_VARIABLE]:
            raise EnvironmentDetectionError(f"{SLOT_VARIABLE}={env[SLOT_VARIABLE]!r} is not HOST:LOCAL_RANK")
        try:
            addr, port = split_address(env[STORE_VARIABLE])
        except ValueError as exc:
            raise EnvironmentDetectionError(f"{exc}; it must be the driver's store address") from None
        rank, size, local_rank, local_size = read_ranks(
            env, "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")
        node_rank, num_nodes = read_nodes(env, "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", size)
        return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, node_rank=node_rank,
                     num_nodes=num_nodes, master_addr=addr, master_port=port, launcher=cls.launcher)

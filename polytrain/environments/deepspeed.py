"""The DeepSpeed launcher (``deepspeed`` CLI → ``deepspeed.launcher.launch`` on each node).

DeepSpeed 0.19 exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, plus
CROSS_RANK (node index), CROSS_SIZE (node count) and LOCAL_SIZE — but no
LOCAL_WORLD_SIZE, GROUP_RANK or TORCHELASTIC_* (those would mean torchrun).
"""

from __future__ import annotations

from polytrain.environments.base import Env, Environment, read_addr, read_nodes, read_port, read_ranks
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World


class DeepSpeedEnvironment(Environment):
    launcher = "deepspeed"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE"))

    @classmethod
    def world(cls, env: Env) -> World:
        rank, size, local_rank, local_size = read_ranks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")
        node_rank, num_nodes = read_nodes(env, "CROSS_RANK", "CROSS_SIZE", size)
        addr, port = read_addr(env), read_port(env)
        if addr is None or port is None:
            missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
            raise EnvironmentDetectionError(f"{missing} is not set; it must be set (the DeepSpeed launcher exports it)")
        return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, node_rank=node_rank,
                     num_nodes=num_nodes, master_addr=addr, master_port=port, launcher=cls.launcher)

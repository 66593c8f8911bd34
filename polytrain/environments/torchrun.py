"""torchrun (torch.distributed.elastic), polytrain's own local launcher, and plain ``env://``.

torchrun 2.x exports, per worker: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK (node index), GROUP_WORLD_SIZE (node count), ROLE_*, MASTER_ADDR, MASTER_PORT
and TORCHELASTIC_* (RUN_ID, RESTART_COUNT, MAX_RESTARTS, ...).
"""

from __future__ import annotations

from polytrain.environments.base import (
    Env,
    Environment,
    nodes_from_local,
    read_addr,
    read_nodes,
    read_port,
    read_ranks,
)
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

_TORCHRUN_ONLY = ("GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")


def world_from_torch_variables(env: Env, launcher: str, *, require_master: bool = True) -> World:
    """A World from the torch.distributed ``env://`` variables (and torchrun's extras when present)."""
    local_rank = "LOCAL_RANK" if "LOCAL_RANK" in env else None
    local_size = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else None
    rank, size, lrank, lsize = read_ranks(env, "RANK", "WORLD_SIZE", local_rank, local_size)
    if local_rank is None and local_size is None:
        lrank, lsize = rank, size  # nothing local is known: one node
    elif local_size is None:
        lsize = size  # LOCAL_RANK alone: the node size is unknown, assume one node
    if "GROUP_RANK" in env and "GROUP_WORLD_SIZE" in env:
        node_rank, num_nodes = read_nodes(env, "GROUP_RANK", "GROUP_WORLD_SIZE", size)
    else:
        node_rank, num_nodes = nodes_from_local(rank, size, lsize)
    addr, port = read_addr(env), read_port(env)
    if require_master and (addr is None or port is None):
        missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
        raise EnvironmentDetectionError(f"{missing} is not set; {launcher} must export MASTER_ADDR and MASTER_PORT")
    return World(rank=rank, size=size, local_rank=lrank, local_size=lsize, node_rank=node_rank,
                 num_nodes=num_nodes, master_addr=addr, master_port=port, launcher=launcher)


class TorchrunEnvironment(Environment):
    launcher = "torchrun"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return "RANK" in env and ("TORCHELASTIC_RUN_ID" in env or all(k in env for k in _TORCHRUN_ONLY))

    @classmethod
    def world(cls, env: Env) -> World:
        return world_from_torch_variables(env, cls.launcher)


class PolytrainLocalEnvironment(TorchrunEnvironment):
    """``polytrain launch`` on one machine: torchrun's variables plus POLYTRAIN_LAUNCHER=local."""

    launcher = "polytrain-local"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return env.get("POLYTRAIN_LAUNCHER") == "local" and "RANK" in env


class EnvInitEnvironment(Environment):
    """The bare ``env://`` convention: RANK, WORLD_SIZE and MASTER_ADDR set by hand or by a script."""

    launcher = "env"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))

    @classmethod
    def world(cls, env: Env) -> World:
        return world_from_torch_variables(env, cls.launcher, require_master=False)

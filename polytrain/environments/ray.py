"""A worker of ``polytrain launch --launcher ray``: Ray Train started it in one of its worker actors with torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` = Ray's node rank,
``MASTER_ADDR``/``MASTER_PORT`` chosen by rank 0's actor) plus ``POLYTRAIN_LAUNCHER=ray``
(`polytrain.launchers.ray`)."""

from __future__ import annotations

from polytrain.environments.base import Env
from polytrain.environments.torchrun import TorchrunEnvironment


class RayEnvironment(TorchrunEnvironment):
    launcher = "ray"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return env.get("POLYTRAIN_LAUNCHER") == "ray" and "RANK" in env

"""No launcher: one process, rank 0 of 1."""

from __future__ import annotations

from polytrain.environments.base import Env, Environment
from polytrain.world import World


class SingleProcessEnvironment(Environment):
    launcher = "single"

    @classmethod
    def detect(cls, env: Env) -> bool:
        return True

    @classmethod
    def world(cls, env: Env) -> World:
        return World()

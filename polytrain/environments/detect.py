"""Launcher detection: one small class per launcher, tried in the order of ``PRECEDENCE``.

The order matters where launchers nest: torchrun, polytrain's local launcher and the
DeepSpeed launcher run inside Slurm allocations (their workers inherit SLURM_*);
horovodrun in MPI mode *is* an mpirun; mpirun runs inside Slurm and LSF allocations; jsrun
with Spectrum MPI also exports Open MPI's variables. The first class whose ``detect``
accepts the environment builds the World.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from polytrain.environments.base import Environment
from polytrain.environments.deepspeed import DeepSpeedEnvironment
from polytrain.environments.elastic import ElasticEnvironment
from polytrain.environments.horovod import HorovodGlooEnvironment, HorovodMpiEnvironment
from polytrain.environments.lsf import LsfEnvironment
from polytrain.environments.mpi import (
    IntelMpiEnvironment,
    MpichEnvironment,
    MvapichEnvironment,
    OpenMpiEnvironment,
)
from polytrain.environments.ray import RayEnvironment
from polytrain.environments.single import SingleProcessEnvironment
from polytrain.environments.slurm import SlurmEnvironment
from polytrain.environments.torchrun import EnvInitEnvironment, PolytrainLocalEnvironment, TorchrunEnvironment
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

PRECEDENCE: tuple[type[Environment], ...] = (
    ElasticEnvironment,  # polytrain's elastic driver: horovodrun-gloo's variables, under any allocation
    PolytrainLocalEnvironment,
    RayEnvironment,  # polytrain's Ray workers: torchrun's variables, and Ray itself may run inside Slurm
    TorchrunEnvironment,
    DeepSpeedEnvironment,
    HorovodGlooEnvironment,
    HorovodMpiEnvironment,
    LsfEnvironment,
    OpenMpiEnvironment,
    MvapichEnvironment,
    IntelMpiEnvironment,
    MpichEnvironment,
    SlurmEnvironment,
    EnvInitEnvironment,
    SingleProcessEnvironment,
)


def environment_for(env: Mapping[str, str]) -> type[Environment]:
    """The first launcher class in ``PRECEDENCE`` that recognises ``env``."""
    return next(cls for cls in PRECEDENCE if cls.detect(env))


def by_launcher(name: str) -> type[Environment] | None:
    """The class whose ``launcher`` is ``name`` (None for an unknown name)."""
    return next((cls for cls in PRECEDENCE if cls.launcher == name), None)


def detect(env: Mapping[str, str]) -> World:
    """The World the launcher described in ``env``; raises EnvironmentDetectionError on a bad dump."""
    return environment_for(env).world(env)


def detect_world(env: Mapping[str, str] | None = None) -> World:
    """The World of this process (``env`` default: ``os.environ``)."""
    return detect(os.environ if env is None else env)


#: Set by torchrun (TorchElastic) and by `polytrain launch --max-restarts` when they restart workers.
RESTART_COUNT_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "POLYTRAIN_RESTART_COUNT")


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted this job's workers: the largest of the variables that
    are set (both can be, when polytrain's local launcher runs under torchrun); 0 when none is.
    A value that is not a non-negative integer is a one-line EnvironmentDetectionError naming it."""
    env = os.environ if env is None else env
    counts = [0]
    for var in RESTART_COUNT_VARIABLES:
        value = env.get(var, "").strip()
        if not value:
            continue
        if not (value.isascii() and value.isdigit()):
            raise EnvironmentDetectionError(f"{var}={value!r}: a restart count must be a non-negative integer "
                                            f"(set by torchrun or polytrain launch; unset it or fix it)")
        counts.append(int(value))
    return max(counts)

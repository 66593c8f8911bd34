"""Launcher detection: one small class per launcher, tried in the order of ``PRECEDENCE``
(`detect`), and the MPI agreement on a master address for launchers that name none (`agree`)."""

from polytrain.environments.agree import ensure_master
from polytrain.environments.base import Environment
from polytrain.environments.deepspeed import DeepSpeedEnvironment
from polytrain.environments.detect import (
    PRECEDENCE,
    by_launcher,
    detect,
    detect_world,
    environment_for,
    restart_count,
)
from polytrain.environments.elastic import ElasticEnvironment
from polytrain.environments.horovod import HorovodGlooEnvironment, HorovodMpiEnvironment
from polytrain.environments.lsf import LsfEnvironment
from polytrain.environments.mpi import (
    IntelMpiEnvironment,
    MpichEnvironment,
    MvapichEnvironment,
    OpenMpiEnvironment,
)
from polytrain.environments.single import SingleProcessEnvironment
from polytrain.environments.slurm import SlurmEnvironment
from polytrain.environments.torchrun import EnvInitEnvironment, PolytrainLocalEnvironment, TorchrunEnvironment

__all__ = [
    "PRECEDENCE", "Environment", "by_launcher", "detect", "detect_world", "ensure_master", "environment_for", "restart_count",
    "DeepSpeedEnvironment", "ElasticEnvironment", "EnvInitEnvironment", "HorovodGlooEnvironment", "HorovodMpiEnvironment",
    "IntelMpiEnvironment", "LsfEnvironment", "MpichEnvironment", "MvapichEnvironment", "OpenMpiEnvironment",
    "PolytrainLocalEnvironment", "SingleProcessEnvironment", "SlurmEnvironment", "TorchrunEnvironment",
]

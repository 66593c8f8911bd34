"""The launchers polytrain knows: one row per `base.Launcher` class, in this order.

Every table about launchers is read from ``LAUNCHERS`` when it is needed: the ``--launcher`` choices and
the ``--emit-*`` flags of ``polytrain launch``, the failure parsers and traceback frames a job's output is
read with, and the binaries ``polytrain info`` reports. A new launcher is a module in ``launchers/`` with
one `Launcher` subclass and its row here.
"""

from __future__ import annotations

from polytrain.errors import LaunchError
from polytrain.launchers.base import Launcher, OutputReading
from polytrain.launchers.deepspeed import DeepspeedLauncher
from polytrain.launchers.failure_report import Parser
from polytrain.launchers.horovodrun import HorovodrunLauncher
from polytrain.launchers.local import LocalLauncher
from polytrain.launchers.lsf import LsfLauncher
from polytrain.launchers.mpirun import MpirunLauncher
from polytrain.launchers.ray import RayLauncher
from polytrain.launchers.srun import SrunLauncher
from polytrain.launchers.torchrun import TorchrunLauncher

#: The order is the order of the ``--launcher`` choices, of ``polytrain info``'s rows and of the failure
#: parsers (where two name the same rank, the first wins).
LAUNCHERS: tuple[type[Launcher], ...] = (
    TorchrunLauncher,
    MpirunLauncher,
    HorovodrunLauncher,
    SrunLauncher,
    DeepspeedLauncher,
    LsfLauncher,
    LocalLauncher,
    RayLauncher,
)


def launcher_names() -> tuple[str, ...]:
    """The ``--launcher`` choices."""
    return tuple(cls.name for cls in LAUNCHERS if cls.starts_jobs)


def failure_parsers() -> tuple[Parser, ...]:
    """Every launcher's failure parsers, each once, in registry order."""
    return tuple(dict.fromkeys(parse for cls in LAUNCHERS for parse in cls.failure_parsers))


def traceback_frames() -> tuple[str, ...]:
    return tuple(dict.fromkeys(frame for cls in LAUNCHERS for frame in cls.traceback_frames))


def output_reading() -> OutputReading:
    """How any launcher's output is read: with every launcher's parsers and frames (see `OutputReading`)."""
    return OutputReading(failure_parsers(), traceback_frames())


def info_binaries() -> tuple[str, ...]:
    """The binaries ``polytrain info`` looks up, in registry order."""
    return tuple(dict.fromkeys(binary for cls in LAUNCHERS for binary in cls.info_binaries))


def batch_script_launchers() -> tuple[type[Launcher], ...]:
    """The launchers that write batch scripts (one ``--emit-...`` flag each)."""
    return tuple(cls for cls in LAUNCHERS if cls.batch_script is not None)


def launcher_class(name: str) -> type[Launcher]:
    """The class ``--launcher name`` chooses; a one-line LaunchError naming the choices for any other name."""
    for cls in LAUNCHERS:
        if cls.starts_jobs and cls.name == name:
            return cls
    raise LaunchError(f"--launcher must be one of {', '.join(launcher_names())}; got {name!r}")


def launcher(name: str) -> Launcher:
    """The launcher ``--launcher name`` chooses, reading its output as `output_reading` says."""
    return launcher_class(name)(output_reading())

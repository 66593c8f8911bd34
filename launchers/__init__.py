"""Launchers: build the real command line of torchrun, mpirun, horovodrun, srun or deepspeed — or start
the processes directly (``local``) — from one `LaunchRequest`.

``build_command(req)`` is pure (the launcher's bare binary name comes first);
``run(req)`` looks the binary up (the venv's ``bin/`` first, then PATH), starts
it and returns its exit code; ``run(req, dry_run=True)`` prints what would run.
"""

from __future__ import annotations

from polytrain.errors import LaunchError
from polytrain.launchers import deepspeed, horovodrun, local, mpirun, srun, torchrun
from polytrain.launchers.args import add_launch_arguments, launch_from_args, request_from_args
from polytrain.launchers.base import (
    LAUNCHER_NAMES,
    HorovodOptions,
    LaunchRequest,
    SlurmOptions,
    find_binary,
    program_for_target,
)
from polytrain.launchers.srun import emit_sbatch

LAUNCHERS = {
    "torchrun": torchrun.LAUNCHER,
    "mpirun": mpirun.LAUNCHER,
    "horovodrun": horovodrun.LAUNCHER,
    "srun": srun.LAUNCHER,
    "deepspeed": deepspeed.LAUNCHER,
    "local": local.LAUNCHER,
}


def get_launcher(name: str):
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHER_NAMES)}; got {name!r}") from None


def build_command(req: LaunchRequest) -> list[str]:
    """The launcher's command line for ``req`` (for ``local``: what each worker runs)."""
    return get_launcher(req.launcher).build_command(req)


def describe(req: LaunchRequest) -> str:
    """What ``run`` would start, as pasteable shell lines (comments start with ``#``)."""
    return get_launcher(req.launcher).describe(req)


def run(req: LaunchRequest, dry_run: bool = False) -> int:
    """Start ``req`` and wait for it; returns the exit code. ``dry_run`` prints instead and returns 0."""
    launcher = get_launcher(req.launcher)
    if dry_run:
        print(launcher.describe(req), flush=True)
        return 0
    return launcher.run(req)


__all__ = [
    "LAUNCHERS",
    "LAUNCHER_NAMES",
    "HorovodOptions",
    "LaunchError",
    "LaunchRequest",
    "SlurmOptions",
    "add_launch_arguments",
    "build_command",
    "describe",
    "emit_sbatch",
    "find_binary",
    "get_launcher",
    "launch_from_args",
    "program_for_target",
    "request_from_args",
    "run",
]

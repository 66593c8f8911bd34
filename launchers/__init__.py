"""Launchers: build the real command line of torchrun, mpirun, horovodrun, srun or deepspeed — or start
the processes directly (``local``) — from one `LaunchRequest`.

``build_command(req)`` is pure (the launcher's bare binary name comes first; a single-host
job's free port is chosen beforehand by ``with_master_port``, so a dry run shows the real port);
``run(req)`` looks the binary up (the venv's ``bin/`` first, then PATH), starts
it and returns its exit code; ``run(req, dry_run=True)`` prints what would run.

When a job fails, ``polytrain launch`` says in one line which rank failed, on which host, and how
(`failure_report`): from what the polytrain workers wrote on the run's exit board (`exit_board`) and
from the launcher's own output, which passes through with the launcher's traceback held back unless
``--debug`` (`launcher_output`).
"""

from __future__ import annotations

from polytrain.errors import LaunchError
from polytrain.launchers.args import add_launch_arguments, launch_from_args, request_from_args
from polytrain.launchers.base import (
    LAUNCHER_NAMES,
    HorovodOptions,
    LaunchRequest,
    SlurmOptions,
    find_binary,
    program_for_target,
)
from polytrain.launchers.dispatch import LAUNCHERS, build_command, describe, get_launcher, run
from polytrain.launchers.srun import emit_sbatch

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

"""Launchers: build the real command line of torchrun, mpirun, horovodrun, srun or deepspeed — or start
the processes directly (``local``) — from one `LaunchRequest`. Each launcher is one `Launcher` class in its
own module; `registry.LAUNCHERS` lists them, and every table about launchers is read from there.

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
    HorovodOptions,
    Launcher,
    LaunchRequest,
    SlurmOptions,
    find_binary,
    program_for_target,
)
from polytrain.launchers.dispatch import build_command, describe, get_launcher, run
from polytrain.launchers.registry import LAUNCHERS, launcher_names
from polytrain.launchers.srun import emit_sbatch

__all__ = [
    "LAUNCHERS",
    "HorovodOptions",
    "LaunchError",
    "LaunchRequest",
    "Launcher",
    "SlurmOptions",
    "add_launch_arguments",
    "build_command",
    "describe",
    "emit_sbatch",
    "find_binary",
    "get_launcher",
    "launch_from_args",
    "launcher_names",
    "program_for_target",
    "request_from_args",
    "run",
]

"""From a launcher's name to its builder, and the three things done with a request: build, describe, run."""

from __future__ import annotations

from polytrain.errors import LaunchError
from polytrain.launchers import deepspeed, horovodrun, local, mpirun, srun, torchrun
from polytrain.launchers.base import LAUNCHER_NAMES, LaunchRequest, with_master_port

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
    req = with_master_port(req)
    if dry_run:
        print(launcher.describe(req), flush=True)
        return 0
    return launcher.run(req)

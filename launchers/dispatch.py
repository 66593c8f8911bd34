"""The three things done with a request, for the launcher its name chooses in the registry: build, describe,
run."""

from __future__ import annotations

from polytrain.launchers import registry
from polytrain.launchers.base import Launcher, LaunchRequest
from polytrain.observe.redact import redact_text


def get_launcher(name: str) -> Launcher:
    """The launcher ``--launcher name`` chooses; a one-line LaunchError naming the choices for any other."""
    return registry.launcher(name)


def with_master_port(req: LaunchRequest) -> LaunchRequest:
    """``req`` with the port its launcher picks for a single-host job that names none (`Launcher.with_master_port`)."""
    return get_launcher(req.launcher).with_master_port(req)


def build_command(req: LaunchRequest) -> list[str]:
    """The launcher's command line for ``req`` (for ``local``: what each worker runs)."""
    return get_launcher(req.launcher).build_command(req)


def describe(req: LaunchRequest) -> str:
    """What ``run`` would start, as pasteable shell lines (comments start with ``#``)."""
    return get_launcher(req.launcher).describe(req)


def run(req: LaunchRequest, dry_run: bool = False) -> int:
    """Start ``req`` and wait for it; returns the exit code. ``dry_run`` prints instead and returns 0."""
    launcher = get_launcher(req.launcher)
    req = launcher.with_master_port(req)
    if dry_run:  # a credential in a URI among the arguments (--set ...tracking_uri=) is printed masked
        print(redact_text(launcher.describe(req)), flush=True)
        return 0
    return launcher.run(req)

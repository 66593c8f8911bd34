"""The ``local`` launcher: N workers on this host, started and supervised by polytrain itself.

Workers see the variables torchrun would give them (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) plus ``POLYTRAIN_LAUNCHER=local``, so ``env://`` rendezvous
works unchanged. With ``max_restarts`` the whole group is restarted on a fresh
port when a worker fails (never after SIGINT/SIGTERM).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

from polytrain.comm.net import free_port
from polytrain.errors import LaunchError
from polytrain.launchers import exit_board
from polytrain.launchers.base import Launcher, LaunchRequest, format_command, is_single_local_host
from polytrain.launchers.failure_report import report_worker_failure
from polytrain.launchers.processes import GRACE_SECONDS, supervise
from polytrain.launchers.stopping import stop_policy

LOOPBACK = "127.0.0.1"

EnvFactory = Callable[[LaunchRequest, int, int], list[dict[str, str]]]  # (req, port, restart count)


def worker_environments(req: LaunchRequest, port: int, restart_count: int = 0) -> list[dict[str, str]]:
    """The extra variables of each worker, in rank order (they win over ``req.env``)."""
    return [
        {
            **req.env,
            "RANK": str(rank),
            "WORLD_SIZE": str(req.nproc),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(req.nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": req.master_addr or LOOPBACK,
            "MASTER_PORT": str(port),
            "POLYTRAIN_LAUNCHER": "local",
            "POLYTRAIN_RESTART_COUNT": str(restart_count),
        }
        for rank in range(req.nproc)
    ]


def check_local(req: LaunchRequest) -> None:
    if not is_single_local_host(req):
        names = ", ".join(host for host, _ in req.hosts)
        raise LaunchError(
            f"--launcher {req.launcher} starts processes on this host only, but -H/--hostfile names {names}; "
            "use mpirun, horovodrun, srun, torchrun or deepspeed for several hosts"
        )


def run_group(
    req: LaunchRequest,
    env_factory: EnvFactory,
    *,
    grace: float = GRACE_SECONDS,
    base_env: Mapping[str, str] | None = None,
) -> int:
    """Start ``req.nproc`` copies of the program with ``env_factory``'s variables, restarting on failure.

    Each attempt gets a fresh port (``req.master_port`` if given) and a fresh exit board (`exit_board`):
    when several workers are seen failed at once, one whose error only says it lost a peer is not the one
    named. Returns the exit code.
    """
    base = dict(os.environ if base_env is None else base_env)
    stop_grace = max(grace, stop_policy(req.program, False).grace)  # a preemptible spec's grace_s
    attempt = 0
    while True:
        port = req.master_port or free_port()
        with exit_board.board() as board:
            envs = [{**base, **extra, exit_board.BOARD_VARIABLE: str(board)}
                    for extra in env_factory(req, port, attempt)]
            outcome = supervise([req.program] * req.nproc, envs, grace=stop_grace,
                                on_failure=lambda codes: report_worker_failure(codes, exit_board.read_board(board)))
        if outcome.code == 0 or outcome.signal is not None or attempt >= req.max_restarts:
            return outcome.code
        attempt += 1
        print(
            f"polytrain: a worker exited with code {outcome.code}; restarting all {req.nproc} "
            f"(restart {attempt} of {req.max_restarts})",
            file=sys.stderr,
            flush=True,
        )


def describe_group(req: LaunchRequest, env_factory: EnvFactory, title: str) -> str:
    """Dry-run text: one pasteable line per worker (the port is one that is free right now)."""
    port = req.master_port or free_port()
    lines = [f"# {title}: {req.nproc} processes on this host"]
    lines += [format_command(req.program, extra, req.env_from_here) for extra in env_factory(req, port, 0)]
    return "\n".join(lines)


class LocalLauncher(Launcher):
    """No launcher binary: the workers' failures are its own to report (`report_worker_failure`)."""

    name = "local"

    def build_command(self, req: LaunchRequest) -> list[str]:
        """What each worker runs (there is no launcher binary in front of it)."""
        return list(req.program)

    def describe(self, req: LaunchRequest) -> str:
        check_local(req)
        return describe_group(req, worker_environments, "polytrain local launcher")

    def run(self, req: LaunchRequest) -> int:
        check_local(req)
        return run_group(req, worker_environments)


LAUNCHER = LocalLauncher()

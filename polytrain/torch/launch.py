"""`Distributed.launch`: start the job's processes from the script itself, when no launcher did (the
``mp.spawn`` case), on this machine.

Each process is started with ``spawn`` (a fresh interpreter: the script must guard its call with
``if __name__ == "__main__":``, as for ``mp.spawn``) and given the variables polytrain's own local launcher
exports (torchrun's RANK, WORLD_SIZE, LOCAL_*, GROUP_*, MASTER_ADDR on loopback, a free MASTER_PORT), so
`Distributed` inside ``main`` finds its world as under ``polytrain launch``. Under a launcher, ``launch`` runs
``main`` in this process once: the launcher's world must then have ``np`` processes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from polytrain.environments import detect_world
from polytrain.errors import TrainingFailure
from polytrain.torch.errors import OwnLoopError

#: how long the other ranks may go on after one failed before they are stopped (they would wait in a collective)
GRACE_S = 5.0


def variables(rank: int, np: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of ``np`` on this machine."""
    return {"RANK": str(rank), "WORLD_SIZE": str(np), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(np),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(np), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "POLYTRAIN_LAUNCHER": "local"}


def _child(main: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.update(env)
    main(*args)


def launch(main: Callable[..., Any], args: tuple[Any, ...], np: int) -> None:
    """Run ``main(*args)`` on ``np`` ranks: in new processes, or here when a launcher started this one."""
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise OwnLoopError(f"launch: np must be a whole number of processes ≥ 1, got {np!r}")
    world = detect_world()
    if world.size > 1 or world.launcher != "single":
        if world.size != np:
            raise OwnLoopError(f"launch: np={np}, but {world.launcher} started {world.size} process(es); start "
                               f"{np} with it, or run the script with plain python and let launch start them")
        main(*args)
        return
    if np == 1:
        main(*args)
        return
    from polytrain.comm.net import port_to_hold

    port = port_to_hold()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_child, args=(main, args, variables(rank, np, port)),
                             name=f"polytrain-rank-{rank}") for rank in range(np)]
    for proc in procs:
        proc.start()
    try:
        failed = _wait(procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    if failed is not None:
        rank, code = failed
        raise TrainingFailure(f"Distributed.launch: rank {rank} of {np} exited with code {code} (its error is "
                              f"above); the other ranks were stopped")


def _wait(procs: list[Any]) -> tuple[int, int] | None:
    """Wait for every process; the first (rank, exit code) that failed, after giving the others ``GRACE_S``."""
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while running:
        for sentinel in wait(list(running)):
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                rest = [procs[r] for r in running.values()]
                wait([p.sentinel for p in rest], timeout=GRACE_S)
                return rank, procs[rank].exitcode
    return None

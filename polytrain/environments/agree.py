"""Completing a World whose launcher named no rendezvous address: the ranks agree over MPI."""

from __future__ import annotations

import dataclasses
import socket

from polytrain.comm.net import address_for_peers, port_to_hold
from polytrain.environments.detect import by_launcher
from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError
from polytrain.world import World


def ensure_master(world: World) -> World:
    """``world`` with master_addr and master_port known, agreed by all ranks when needed.

    Unchanged for a single process or when both are known (but see below). Otherwise — e.g. a plain
    ``mpirun`` without MASTER_ADDR/MASTER_PORT — rank 0 picks its address (127.0.0.1
    when every rank shares its host) and a free port, and broadcasts them over MPI
    (mpi4py, imported only here). The host names gathered on the way also give the
    exact node_rank and num_nodes. Every rank must call this together.

    An MPI launcher names no node index: the environment guesses it assuming ranks fill
    nodes in order, which Hydra's default round-robin ``-hosts h1,h2`` and Open MPI's
    ``--map-by node`` break. So when such a job spans nodes, the host names are gathered
    even with both variables known (best effort: without mpi4py the guess stands).
    """
    if world.launcher == "single":
        return world
    environment = by_launcher(world.launcher)
    if world.master_known:
        if environment is not None and environment.speaks_mpi and world.local_size < world.size:
            try:
                return _agree_over_mpi(world, strict=False)
            except BackendUnavailableError:  # no mpi4py: keep the in-order guess
                return world
        return world
    if environment is None or not environment.speaks_mpi:
        missing = " and ".join(name for name, value in (("MASTER_ADDR", world.master_addr),
                                                         ("MASTER_PORT", world.master_port)) if value is None)
        raise EnvironmentDetectionError(
            f"{missing} not set and launcher {world.launcher!r} gives no way to agree on it; export MASTER_ADDR and "
            "MASTER_PORT (rank 0's host and a free port) for every process")
    return _agree_over_mpi(world)


def _port_at(addr: str, count: int) -> int:
    """A port free at ``addr``, the address rank 0's store will listen on, with the ``count - 1`` after it free
    too (tf-multiworker's workers listen on ``master_port + 1 + local rank``), below the ephemeral range
    (`port_to_hold`); where this host cannot bind it (a MASTER_ADDR naming another host, or a name for this
    one that resolves elsewhere), a port free on every interface. The probe closes at once: nothing stays
    listening."""
    try:
        socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
        return port_to_hold(addr, count=count)
    except OSError:
        return port_to_hold("", count=count)


def _agree_over_mpi(world: World, strict: bool = True) -> World:
    """``strict``: an mpi4py that sees another world than the launcher's (built for another MPI) is an
    error; otherwise ``world`` is returned as it is."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendUnavailableError(
            "mpi4py is not installed; install it (pip install mpi4py) or export MASTER_ADDR and MASTER_PORT") from None
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (world.rank, world.size):
        if not strict:
            return world
        raise EnvironmentDetectionError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()} but the {world.launcher} variables say rank "
            f"{world.rank} of {world.size}; launch with that launcher's own mpirun")
    hosts: list[str] = comm.allgather(socket.gethostname())
    choice: tuple[str, str, int] | None = None
    if world.rank == 0:
        try:
            addr = world.master_addr or address_for_peers(hosts)
            port = world.master_port or _port_at(addr, 1 + world.local_size)
            choice = ("ok", addr, port)
        except OSError as exc:  # tell the other ranks instead of leaving them in bcast
            choice = ("error", f"rank 0 could not pick a master address/port: {exc}", 0)
    status, addr, port = comm.bcast(choice, root=0)
    if status != "ok":
        raise EnvironmentDetectionError(f"{addr}; export MASTER_ADDR and MASTER_PORT")
    nodes = list(dict.fromkeys(hosts))
    return dataclasses.replace(world, master_addr=addr, master_port=int(port),
                               node_rank=nodes.index(hosts[world.rank]), num_nodes=len(nodes))

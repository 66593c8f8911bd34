"""Where this process sits in the job: rank, size, node, master address.

`World` is what every other part of polytrain reads; `detect_world()` builds it from
the environment the launcher left, trying one small environment class per launcher
in an explicit order (see ``polytrain.environments.PRECEDENCE``).

Some launchers (a plain ``mpirun``) name no rendezvous address for torch/gloo: their
World has ``master_port=None`` (and ``master_addr=None`` when the ranks may span nodes).
`ensure_master()` fills both in by agreeing over MPI.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    #: None: not known yet, see ``ensure_master``.
    master_addr: str | None = "127.0.0.1"
    #: None: not known yet, see ``ensure_master``.
    master_port: int | None = None
    launcher: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def master_known(self) -> bool:
        return self.master_addr is not None and self.master_port is not None


def detect_world(env: Mapping[str, str] | None = None) -> World:
    """Return the World described by ``env`` (default: ``os.environ``)."""
    from polytrain.environments import detect

    return detect(os.environ if env is None else env)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now (the OS picks it)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(sockaddr)
        return int(sock.getsockname()[1])


def route_address(peer: str | None = None) -> str:
    """This host's IPv4 address on the route towards ``peer`` (default: the default route), which
    other hosts can reach — unlike ``gethostbyname(gethostname())``, which is 127.0.1.1 or 127.0.0.1
    on many distributions. A UDP connect sends nothing. Loopback for a loopback peer; the host
    name's address when there is no route at all."""
    if peer in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(peer) if peer else "192.0.2.1", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: the OS picks one), kept open for the life of
    the process: a TCPStore serves on its file descriptor (``master_listen_fd``), so that the store
    listens on that address only, not on every interface as it would bind by itself."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    _LISTENING.append(sock)
    return sock


_LISTENING: list[socket.socket] = []


def ensure_master(world: World) -> World:
    """``world`` with master_addr and master_port known, agreed by all ranks when needed.

    Unchanged for a single process or when both are known. Otherwise — e.g. a plain
    ``mpirun`` without MASTER_ADDR/MASTER_PORT — rank 0 picks its address (127.0.0.1
    when every rank shares its host) and a free port, and broadcasts them over MPI
    (mpi4py, imported only here). The host names gathered on the way also give the
    exact node_rank and num_nodes. Every rank must call this together.
    """
    if world.launcher == "single" or world.master_known:
        return world
    from polytrain.environments import by_launcher

    environment = by_launcher(world.launcher)
    if environment is None or not environment.speaks_mpi:
        missing = " and ".join(name for name, value in (("MASTER_ADDR", world.master_addr),
                                                         ("MASTER_PORT", world.master_port)) if value is None)
        raise EnvironmentDetectionError(
            f"{missing} not set and launcher {world.launcher!r} gives no way to agree on it; export MASTER_ADDR and "
            "MASTER_PORT (rank 0's host and a free port) for every process")
    return _agree_over_mpi(world)


def _agree_over_mpi(world: World) -> World:
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendUnavailableError(
            "mpi4py is not installed; install it (pip install mpi4py) or export MASTER_ADDR and MASTER_PORT") from None
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (world.rank, world.size):
        raise EnvironmentDetectionError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()} but the {world.launcher} variables say rank "
            f"{world.rank} of {world.size}; launch with that launcher's own mpirun")
    hosts: list[str] = comm.allgather(socket.gethostname())
    choice: tuple[str, str, int] | None = None
    if world.rank == 0:
        try:
            addr = world.master_addr or _address_for_peers(hosts)
            port = world.master_port or free_port("127.0.0.1" if addr == "127.0.0.1" else "0.0.0.0")
            choice = ("ok", addr, port)
        except OSError as exc:  # tell the other ranks instead of leaving them in bcast
            choice = ("error", f"rank 0 could not pick a master address/port: {exc}", 0)
    status, addr, port = comm.bcast(choice, root=0)
    if status != "ok":
        raise EnvironmentDetectionError(f"{addr}; export MASTER_ADDR and MASTER_PORT")
    nodes = list(dict.fromkeys(hosts))
    return dataclasses.replace(world, master_addr=addr, master_port=int(port),
                               node_rank=nodes.index(hosts[world.rank]), num_nodes=len(nodes))


def _address_for_peers(hosts: list[str]) -> str:
    """Rank 0's address as the other ranks can reach it (``hosts[0]`` is rank 0's host name)."""
    peers = [h for h in hosts if h != hosts[0]]
    if not peers:
        return "127.0.0.1"
    try:
        peer_ip = socket.gethostbyname(peers[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer_ip, 9))  # a UDP connect sends nothing; it only picks the route's interface
            return str(probe.getsockname()[0])
    except OSError:
        return hosts[0]

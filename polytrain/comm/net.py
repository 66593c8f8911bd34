"""Network helpers shared by launchers, backends and side channels: ports, addresses, listeners.

Nothing here imports a framework. Single-host jobs keep everything on loopback; multi-host jobs
advertise the address on the route towards the master (see `route_address`).
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now (the OS picks it; "" means every interface)."""
    if host == "":
        family, sockaddr = socket.AF_INET, ("", 0)
    else:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(sockaddr)
        return int(sock.getsockname()[1])


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default 32768-60999 where unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_to_hold(host: str = "127.0.0.1", taken: set[int] | frozenset[int] = frozenset(), count: int = 1) -> int:
    """A free port for a listener that starts later: below the kernel's ephemeral range, so the local end
    of an outgoing connection (gloo opens many) cannot take it meanwhile, as it can a `free_port`. With
    ``count``, the first of that many free ports in a row (a master port and the ports derived from it, as
    tf-multiworker's ``master_port + 1 + local rank``). Falls back to `free_port` when none is free."""
    low, _ = ephemeral_range()
    first = max(1024, low - 12000)
    candidates = [port for port in random.sample(range(first, max(first, low - count + 1)),
                                                 min(200, max(0, low - count + 1 - first)))
                  if not taken.intersection(range(port, port + count))]
    for port in candidates:
        if all(_bindable(host, p) for p in range(port, port + count)):
            return port
    return free_port(host)


def _bindable(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
        return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host) if host == "localhost" else host).is_loopback
    except (ValueError, OSError):
        return False


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def keep_gloo_on_loopback(master_addr: str | None) -> None:
    """On a loopback master every rank is on this host: gloo needs no other interface (unless the user
    named one with ``GLOO_SOCKET_IFNAME``)."""
    if is_loopback(str(master_addr)) and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = loopback_interface()
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def route_address(peer: str | None = None) -> str:
    """This host's IPv4 address on the route towards ``peer`` (default: the default route), which
    other hosts can reach — unlike ``gethostbyname(gethostname())``, which is 127.0.1.1 or 127.0.0.1
    on many distributions. A UDP connect sends nothing. Loopback for a loopback peer; the host
    name's address when there is no route at all."""
    if peer in LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        return _address_towards(peer or "192.0.2.1")
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _address_towards(host: str) -> str:
    """The local IPv4 address of the interface on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])


def addresses_of(host: str) -> list[str]:
    """What ``host`` resolves to on this machine (IP literals as they are), or nothing."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_local_address(address: str) -> bool:
    """Whether a socket can bind ``address`` here (it is one of this host's addresses)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class StoreBind:
    """Where rank 0's rendezvous store listens: ``address`` (None: every interface) and why."""

    address: str | None
    why: str


def store_bind(master: str, all_local: bool) -> StoreBind:
    """The address rank 0 binds the store that every rank reaches at ``master``: the address ``master``
    names on this host, which is what the ranks that connect to it reach — loopback when every rank is on
    this host. A name that resolves to loopback here although ranks run on other hosts (Debian's
    ``127.0.1.1 <hostname>`` in /etc/hosts) reaches this host's ranks on loopback and the others on its
    network address: no one address serves both, so then every interface (and ``why`` says so, as when
    ``master`` names no address of this host)."""
    if is_loopback(master):
        return StoreBind(master, "single node: loopback only")
    found = [a for a in addresses_of(master) if is_local_address(a)]
    network = [a for a in found if not _is_loopback_ip(a)]
    if all_local and found:
        where = f"the address {master} names here" if found[0] in network else f"{master} is loopback here"
        return StoreBind(found[0], f"single node: {where}")
    if network:
        return StoreBind(network[0], f"multi-node: the address {master} names here")
    if found:
        return StoreBind(None, f"multi-node: {master} is {found[0]} (loopback) on this host, the other hosts reach "
                               f"it at another address; export MASTER_ADDR as an address every host reaches")
    return StoreBind(None, f"multi-node: {master} names no address of this host")


def board_address(master: str | None) -> str | None:
    """An address of this host that ranks on other hosts reach, for a listener whose address rank 0 sends
    them itself (the watchdog's store): ``master``'s own when it names a non-loopback address here, else
    the address on the default route; None when this host has no such address."""
    candidates = addresses_of(master) if master else []
    try:
        candidates.append(_address_towards("192.0.2.1"))
    except OSError:
        pass
    return next((a for a in candidates if not _is_loopback_ip(a) and is_local_address(a)), None)


def _is_loopback_ip(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def address_for_peers(hosts: list[str]) -> str:
    """Rank 0's address as the other ranks can reach it (``hosts[0]`` is rank 0's host name; loopback
    when every rank shares it)."""
    peers = [h for h in hosts if h != hosts[0]]
    if not peers:
        return "127.0.0.1"
    try:
        return _address_towards(peers[0])
    except OSError:
        return hosts[0]


def listening_sockets(pid: int) -> list[tuple[str | None, int]]:
    """Every TCP socket process ``pid`` listens on, as ``(address, port)``, the address None for every interface
    (``0.0.0.0``, ``::``), read from /proc (Linux); empty where /proc cannot tell."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found: list[tuple[str | None, int]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            host = _proc_address(address)
            found.append((None if ipaddress.ip_address(host).is_unspecified else host, int(port, 16)))
    return sorted(set(found), key=lambda item: (item[1], item[0] or ""))


def _proc_address(text: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words of hex in the host's byte order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] if sys.byteorder == "little" else raw[i:i + 4] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (from /proc; None where it cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (name) state"
    except (OSError, ValueError, IndexError):
        return None


def ancestor_listening_on(port: int, levels: int = 4) -> int | None:
    """The nearest ancestor of this process (its parent first, at most ``levels`` up) that listens on TCP
    ``port`` — where torchrun's agent, which started this worker, hosts its store — or None."""
    pid: int | None = os.getpid()
    for _ in range(levels):
        pid = parent_pid(pid) if pid else None
        if not pid or pid <= 1:
            return None
        if any(listened == port for _, listened in listening_sockets(pid)):
            return pid
    return None


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: the OS picks one), kept open for the life of
    the process: a TCPStore serves on its file descriptor (``master_listen_fd``), so that the store
    listens on that address only, not on every interface as it would bind by itself."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    # as TCPStore's own socket: the port of a store that just closed (its connections in TIME_WAIT for a
    # minute) can be bound again at once; a port another socket listens on is still refused (EADDRINUSE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    _LISTENING.append(sock)
    return sock


_LISTENING: list[socket.socket] = []

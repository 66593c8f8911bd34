"""What a cluster host does to its network beyond ssh: traffic control on its link (netem, an htb rate cap)
and the TCP sockets listening in its namespace. `HostNetwork` is a mixin of `netns.Host` (which gives it
``netns``, ``veth``, ``interface`` and ``run``)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path


class ClusterUnavailable(RuntimeError):
    """Namespaces, sshd or a qdisc cannot be made here; the message says why (tests skip with it)."""


class HostNetwork:
    netns: str
    veth: str
    interface: str

    def run(self, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:  # see netns.Host.run
        raise NotImplementedError

    def _qdisc(self, args: list[str] | None) -> None:
        """Replace the root qdisc on both ends of this host's link with ``args`` (None: back to the default)."""
        for prefix, dev in (([], self.veth), (["ip", "netns", "exec", self.netns], self.interface)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            if args is None:
                continue
            for step in args:
                done = subprocess.run([*prefix, "tc", *step.replace("DEV", dev).split()], capture_output=True,
                                      text=True, timeout=30)
                if done.returncode:
                    raise ClusterUnavailable(f"tc {step.replace('DEV', dev)}: {done.stderr.strip()}")

    def netem(self, spec: str | None) -> None:
        """``tc netem`` on both directions of this host's link (e.g. ``"loss 5% delay 20ms"``); None removes it.
        Raises `ClusterUnavailable` where the kernel has no netem qdisc."""
        self._qdisc(None if spec is None else [f"qdisc add dev DEV root netem {spec}"])

    def rate_limit(self, rate: str | None) -> None:
        """An ``htb`` bandwidth cap (e.g. ``"2mbit"``) on both directions of this host's link; None removes it."""
        self._qdisc(None if rate is None else ["qdisc add dev DEV root handle 1: htb default 1",
                                               f"class add dev DEV parent 1: classid 1:1 htb rate {rate}"])

    def rate_limit_with(self, peer_addr: str, rate: str) -> None:
        """An ``htb`` cap on the traffic between this host and ``peer_addr`` only, both ways (a u32 filter on the
        peer's address: out of this host by destination, into it by source); ``netem(None)`` removes it."""
        for prefix, dev, match in (([], self.veth, "src"), (["ip", "netns", "exec", self.netns], self.interface, "dst")):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            for step in ("qdisc add dev DEV root handle 1: htb default 1",
                         "class add dev DEV parent 1: classid 1:1 htb rate 10gbit",
                         f"class add dev DEV parent 1: classid 1:2 htb rate {rate}",
                         f"filter add dev DEV parent 1: protocol ip prio 1 u32 match ip {match} {peer_addr}/32 "
                         "flowid 1:2"):
                done = subprocess.run([*prefix, "tc", *step.replace("DEV", dev).split()], capture_output=True,
                                      text=True, timeout=30)
                if done.returncode:
                    raise ClusterUnavailable(f"tc {step.replace('DEV', dev)}: {done.stderr.strip()}")

    def qdisc_supported(self, kind: str) -> bool:
        """Whether the kernel has qdisc ``kind`` (netem is a module some kernels lack)."""
        args = {"netem": "netem delay 1ms", "htb": "htb"}.get(kind, kind)
        ns = ["ip", "netns", "exec", self.netns]
        done = subprocess.run([*ns, "tc", "qdisc", "add", "dev", "lo", "root", *args.split()], capture_output=True,
                              timeout=30)
        subprocess.run([*ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=30)
        return done.returncode == 0

    def listening(self, pids: Sequence[int] | None = None) -> list[tuple[str, int]]:
        """(address, port) of the TCP sockets listening in this namespace (from /proc/net/tcp and tcp6);
        with ``pids``, only those sockets these processes hold."""
        out = self.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
        inodes = None if pids is None else _socket_inodes(pids)
        found = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: LISTEN
                continue
            if inodes is not None and fields[9] not in inodes:
                continue
            hexaddr, hexport = fields[1].split(":")
            found.append((_decode_address(hexaddr), int(hexport, 16)))
        return found


def _socket_inodes(pids: Sequence[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            entries = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                link = os.readlink(entry)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes


def _decode_address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    data = b"".join(words)
    if data[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in data[12:])
    return str(ipaddress.IPv6Address(data))

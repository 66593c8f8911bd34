"""Host order, slot assignment and the blacklist of the elastic driver (Horovod's rules).

- Order: hosts that stay keep their relative order; new hosts come after, in the order discovery listed them.
- Slots: ranks are contiguous per host, hosts in that order, up to ``max_np`` (the last host may be used in
  part). A worker is the slot ``host:local_rank``; its local rank never changes, its rank may.
- Blacklist: a host where a worker failed is out. Without a cooldown range for good; with ``(lo, hi)`` its
  n-th blacklisting lasts ``clamp(lo * 2**n + U(0, 1) * lo, lo, hi)`` seconds, after which discovery may bring
  it back (reported as a host added).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

REMOVED, ADDED = 1, 2  # = polytrain.comm.membership.REMOVED / ADDED


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker's place in a membership version."""

    hostname: str
    local_rank: int
    rank: int
    size: int
    local_size: int
    cross_rank: int
    cross_size: int

    @property
    def key(self) -> str:
        return f"{self.hostname}:{self.local_rank}"

    def published(self) -> dict[str, int | str]:
        """The value under ``v/{N}`` ``slots`` (`polytrain.comm.membership.assignment_from` reads it)."""
        return {"rank": self.rank, "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size, "hostname": self.hostname}

    def horovod_env(self) -> dict[str, str]:
        return {
            "HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def order_hosts(available: Iterable[str], previous: Sequence[str]) -> list[str]:
    """``available`` hosts ordered: those in ``previous`` first, in its order; new ones after, as given."""
    available = list(dict.fromkeys(available))
    kept = [host for host in previous if host in available]
    return kept + [host for host in available if host not in kept]


def assign_slots(order: Sequence[str], host_slots: Mapping[str, int], max_np: int | None = None) -> list[Slot]:
    """Every slot of the hosts in ``order``, ranks contiguous per host, at most ``max_np`` of them."""
    placed: list[tuple[str, int]] = []
    for host in order:
        for local_rank in range(host_slots[host]):
            if max_np is not None and len(placed) == max_np:
                break
            placed.append((host, local_rank))
    local_sizes: dict[str, int] = {}
    at_local_rank: dict[int, list[str]] = {}
    for host, local_rank in placed:
        local_sizes[host] = local_sizes.get(host, 0) + 1
        at_local_rank.setdefault(local_rank, []).append(host)
    return [Slot(host, local_rank, rank, len(placed), local_sizes[host], at_local_rank[local_rank].index(host),
                 len(at_local_rank[local_rank])) for rank, (host, local_rank) in enumerate(placed)]


def host_change(previous: Mapping[str, int], current: Mapping[str, int]) -> int:
    """`REMOVED` | `ADDED` flags between two discoveries (a host gone or with fewer slots: removed; a new host
    or more slots: added); 0 when equal."""
    flags = 0
    for host, slots in previous.items():
        if current.get(host, 0) < slots:
            flags |= REMOVED
    for host, slots in current.items():
        if previous.get(host, 0) < slots:
            flags |= ADDED
    return flags


@dataclasses.dataclass
class HostState:
    """One host's blacklisting: how often, and until when (0: not cooling down)."""

    count: int = 0
    blacklisted: bool = False
    until: float = 0.0


class Blacklist:
    """Hosts out of the job, with Horovod's cooldown and exponential backoff when ``cooldown`` is given."""

    def __init__(self, cooldown: tuple[int, int] | None = None, clock: Callable[[], float] = time.time,
                 uniform: Callable[[], float] = random.random) -> None:
        self.cooldown = cooldown
        self.clock = clock
        self.uniform = uniform
        self.states: dict[str, HostState] = {}
        self.why: dict[str, str] = {}

    def add(self, host: str, why: str) -> float | None:
        """Blacklist ``host`` (``why``: what its worker did); the cooldown in seconds, None when for good."""
        state = self.states.setdefault(host, HostState())
        self.why[host] = why
        if state.blacklisted and (self.cooldown is None or state.until > self.clock()):
            return None if self.cooldown is None else state.until - self.clock()
        state.blacklisted = True
        if self.cooldown is None:
            return None
        lo, hi = self.cooldown
        state.count += 1
        delay = max(lo, min(hi, lo * (1 << state.count) + self.uniform() * lo))
        state.until = self.clock() + delay
        return delay

    def is_out(self, host: str) -> bool:
        state = self.states.get(host)
        return state is not None and state.blacklisted

    def resurrect(self) -> list[str]:
        """Hosts whose cooldown is over, back in (their count kept for the next backoff)."""
        now, back = self.clock(), []
        for host, state in self.states.items():
            if state.blacklisted and self.cooldown is not None and 0 < state.until <= now:
                state.blacklisted, state.until = False, 0.0
                back.append(host)
        return back

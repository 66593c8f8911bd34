"""An elastic worker's side of the driver's store: its assignment per version, leaving a round, the next round.

polytrain's elastic driver (`polytrain.launchers.elastic`) alone decides who is in the job. It hosts one
``torch.distributed.TCPStore`` and publishes, under the prefix `PREFIX`, a versioned membership (the
keys are listed in docs/DESIGN.md, "The elastic driver"). This module is the only client of those keys on
the worker side, and it is framework-neutral: it reads and writes JSON, and never forms a process group
(`polytrain.adapters.torch.reform` does that, for version N, on `Membership.store`).

The API every client (``hvd.elastic``, the Trainer, the own loops) uses::

    m = Membership.from_env()              # None when this process is no elastic worker
    a = m.assignment(m.version)            # this worker's Assignment at its spawn version
    ...  a collective failed, or a host update was agreed ...
    m.leave(a.version)                     # tell the driver this worker left round N
    a = m.next(a.version)                  # blocks until round N+1; None: removed, exit 0
                                           # raises JobEnded when the driver ended the job
                                           # (final=True: a final round is returned, a.final its line)
    m.hosts_update()                       # (ts, flags) of the latest host change, or None

One `Membership` per thread: its store connection must not be shared between threads (a thread that watches
`hosts_update` while the main thread trains calls ``Membership.from_env()`` for a connection of its own).

Worker environment (set by the driver at spawn, never rewritten): `STORE_VARIABLE` (``addr:port``),
`SLOT_VARIABLE` (``host:local_rank``), `VERSION_VARIABLE` (N at spawn), `TIMEOUT_VARIABLE` (the elastic
timeout in seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

PREFIX = "polytrain/elastic"
STORE_VARIABLE = "POLYTRAIN_ELASTIC_STORE"
SLOT_VARIABLE = "POLYTRAIN_ELASTIC_SLOT"
VERSION_VARIABLE = "POLYTRAIN_ELASTIC_VERSION"
TIMEOUT_VARIABLE = "POLYTRAIN_ELASTIC_TIMEOUT"
#: Host-change flags in the ``hosts`` key (Horovod's ``HostUpdateResult``).
REMOVED, ADDED = 1, 2
POLL_S = 0.02  # how often `Membership.next` looks for the next round (a local store read)


def version_key(version: int) -> str:
    return f"v/{version}"


def left_key(version: int, slot: str) -> str:
    return f"left/{version}/{slot}"


def group_prefix(version: int) -> str:
    """The prefix (under `PREFIX`) of the store of version N's process group."""
    return f"pg/{version}"


class JobEnded(Exception):
    """The driver ended the job while this worker waited for a round: exit with `code` (0 when ``ok``)."""

    def __init__(self, ok: bool, line: str) -> None:
        super().__init__(line)
        self.ok = ok
        self.line = line

    @property
    def code(self) -> int:
        return 0 if self.ok else 1


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One worker's place in membership version ``version`` (Horovod's slot info)."""

    version: int
    slot: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    #: set in a final round: the driver could not find ``--min-np`` slots within ``--elastic-timeout`` and formed
    #: this last, smaller round only so that the survivors write their last commit to disk; the job's end line
    final: str | None = None

    def horovod_env(self) -> dict[str, str]:
        """The ``HOROVOD_*`` slot variables this assignment stands for."""
        return {
            "HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def assignment_from(version: int, slot: str, published: Mapping[str, Any]) -> Assignment | None:
    """``slot``'s Assignment in a published ``v/{N}`` value; None when the slot is not in it."""
    info = published.get("slots", {}).get(slot)
    if info is None:
        return None
    return Assignment(version=version, slot=slot, size=int(published["size"]), final=published.get("final"),
                      **{k: (str(info[k]) if k == "hostname" else int(info[k]))
                         for k in ("rank", "local_rank", "local_size", "cross_rank", "cross_size", "hostname")})


def is_elastic(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: this process's) is an elastic worker's, started by polytrain's driver."""
    env = os.environ if env is None else env
    return STORE_VARIABLE in env and SLOT_VARIABLE in env


def split_address(text: str) -> tuple[str, int]:
    """``addr:port`` (an IPv6 address may be bracketed) -> (addr, port); ValueError otherwise."""
    addr, sep, port = text.rpartition(":")
    if not sep or not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{STORE_VARIABLE}={text!r} is not ADDR:PORT")
    return addr.strip("[]"), int(port)


class Membership:
    """The client of the driver's store for one worker (slot ``host:local_rank``)."""

    def __init__(self, store: Any, slot: str, version: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore

        self.store = store  # the raw store: a process group of version N lives under PREFIX/pg/N
        self.keys = PrefixStore(PREFIX, store)
        self.slot = slot
        self.version = version  # the version this process was spawned for
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Membership | None:
        """Connect to the driver's store named in ``env`` (default: this process's); None when not elastic."""
        from torch.distributed import TCPStore

        env = os.environ if env is None else env
        if not is_elastic(env):
            return None
        addr, port = split_address(env[STORE_VARIABLE])
        timeout_s = float(env.get(TIMEOUT_VARIABLE, "600"))
        store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(timeout_s, 30.0)))
        return cls(store, env[SLOT_VARIABLE], int(env.get(VERSION_VARIABLE, "0")), timeout_s)

    def _get(self, key: str) -> Any:
        return json.loads(self.keys.get(key).decode())

    def _has(self, key: str) -> bool:
        return bool(self.keys.check([key]))

    def latest_version(self) -> int:
        """The newest membership version the driver published."""
        return int(self._get("version"))

    def assignment(self, version: int) -> Assignment | None:
        """This worker's assignment at ``version`` (waits until it is published); None when not a member."""
        return assignment_from(version, self.slot, self._get(version_key(version)))

    def leave(self, version: int) -> None:
        """Tell the driver this worker left round ``version`` (its group failed, or a host update was agreed) and
        waits for the next one. Release the process group first: peers still in it wait on this one's sockets."""
        self.keys.set(left_key(version, self.slot), "1")

    def ended(self) -> JobEnded | None:
        """The driver's end of the job, when it ended it; else None."""
        if not self._has("end"):
            return None
        end = self._get("end")
        return JobEnded(bool(end["ok"]), str(end["line"]))

    def next(self, version: int, timeout_s: float | None = None, final: bool = False) -> Assignment | None:
        """Block until round ``version + 1`` is published; this worker's assignment in it, None when it is not in
        it (removed: exit 0). Raises `JobEnded` when the driver ends the job first, TimeoutError after
        ``timeout_s`` (default: none; a driver that went away breaks the store connection instead). A final round
        (`Assignment.final`) is the job's end (`JobEnded`) unless ``final``: a client that writes its last commit
        to disk there."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        key = version_key(version + 1)
        while True:
            if self._has(key):
                following = self.assignment(version + 1)
                if following is not None and following.final and not final:
                    raise JobEnded(False, following.final)
                return following
            ended = self.ended()
            if ended is not None:
                raise ended
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no membership version {version + 1} within {timeout_s:g} s")
            time.sleep(POLL_S)

    def hosts_update(self) -> tuple[float, int] | None:
        """``(ts, flags)`` of the latest host change the driver saw (ts > 0, increasing; flags `REMOVED` |
        `ADDED`), or None when there was none."""
        if not self._has("hosts"):
            return None
        update = self._get("hosts")
        return float(update["ts"]), int(update["flags"])

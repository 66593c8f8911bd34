"""The elastic driver: membership versions on its own store, rounds, and the job's end (docs/DESIGN.md, "The
elastic driver"; Horovod's rules in the research notes).

One loop, no threads: discovery every interval, workers' exits, the ``left/{N}/{slot}`` keys. A round ends
when every worker of version N has recorded (left: READY; exited 0: SUCCESS; else FAILURE); then, in
Horovod's order: a SUCCESS ends the job; all FAILURE ends it failed; hosts with a FAILURE are blacklisted
(their other workers killed); every host blacklisted ends it; past ``--reset-limit`` ends it; else wait (up
to ``--elastic-timeout``) for ``--min-np`` slots and publish version N+1 (survivors keep their order, new
hosts after), starting workers for new slots. When the slots do not come, the survivors get a final round
(version N+1 with ``final``: the end's line) in which they only write their last commit to disk
(`polytrain.comm.membership.Assignment.final`); the job ends failed when they exit. The end is one line on
stderr and the ``end`` key, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from polytrain.comm.membership import (
    PREFIX,
    SLOT_VARIABLE,
    STORE_VARIABLE,
    TIMEOUT_VARIABLE,
    VERSION_VARIABLE,
    left_key,
    version_key,
)
from polytrain.errors import LaunchError
from polytrain.launchers.elastic import hosts as hostrules
from polytrain.launchers.elastic.discovery import DiscoveryError
from polytrain.launchers.elastic.options import ElasticOptions
from polytrain.launchers.elastic.workers import Worker

TICK_S = 0.05
END_GRACE_S = 5.0  # how long workers waiting for a round get to see the end and exit by themselves
STRAGGLER_GRACE_S = 10.0  # beyond the group timeout, before an unrecorded worker of a failed round is killed
PREFIX_LINE = "polytrain elastic:"

Starter = Callable[[hostrules.Slot, Mapping[str, str]], Worker]


def say(line: str) -> None:
    print(f"{PREFIX_LINE} {line}", file=sys.stderr, flush=True)


def host_store(addr: str, timeout_s: float) -> Any:
    """A TCPStore master on a socket bound to ``addr`` only (never every interface); the store owns the socket."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore(addr, port, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=max(timeout_s, 60.0)), master_listen_fd=sock.detach())


class Ended(Exception):
    """The job ends with ``code`` (the line was said)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Driver:
    """Runs one elastic job; `run` returns its exit code (0 ok, 1 failed)."""

    def __init__(self, options: ElasticOptions, discovery: Any, store: Any, store_addr: str,
                 start: Starter, interval_s: float, group_timeout_s: float = 30.0) -> None:
        from torch.distributed import PrefixStore

        self.options = options
        self.discovery = discovery
        self.keys = PrefixStore(PREFIX, store)
        self.store_addr = store_addr
        self.start = start
        self.interval_s = interval_s
        self.straggler_s = group_timeout_s + STRAGGLER_GRACE_S
        self.end_grace_s = END_GRACE_S
        self.stopping = False
        #: a worker is being started (and is not yet in `workers`): a signal then ends the job once it is
        self.spawning = False
        self.pending_signal: int | None = None
        self.blacklist = hostrules.Blacklist(options.cooldown)
        self.host_slots: dict[str, int] = {}
        self.order: list[str] = []
        self.version = -1
        self.slots: dict[str, hostrules.Slot] = {}
        self.workers: dict[str, Worker] = {}
        self.gone: list[Worker] = []  # workers no longer in the membership, until they exit
        self.recorded: dict[str, tuple[str, int]] = {}
        self.fresh: set[str] = set()  # the slots whose workers were started for this round
        self.first_record = 0.0
        self.resets = 0
        self.hosts_ts = 0.0
        self.next_discovery = 0.0
        self.final: str | None = None  # the end's line, once a final round is published

    # -- hosts -------------------------------------------------------------------------------------------
    def available(self) -> list[str]:
        self.order = hostrules.order_hosts([h for h in self.host_slots if not self.blacklist.is_out(h)], self.order)
        return self.order

    def count_available(self) -> int:
        return sum(self.host_slots[h] for h in self.available())

    def next_slots(self) -> list[hostrules.Slot]:
        return hostrules.assign_slots(self.available(), self.host_slots, self.options.max_np)

    def discover(self, first: bool = False) -> None:
        try:
            found = self.discovery.find()
        except DiscoveryError as exc:
            if first:
                raise LaunchError(str(exc)) from None
            say(f"{exc}; keeping the hosts found before")
            return
        back = self.blacklist.resurrect()
        if found == self.host_slots and not back:
            return
        flags = hostrules.host_change(self.host_slots, found) | (hostrules.ADDED if back else 0)
        self.host_slots = found
        if self.version >= 0:
            self.notify(flags)

    def notify(self, flags: int) -> None:
        """Write ``hosts`` when the change alters the next membership (Horovod tells rank 0 only then)."""
        upcoming = self.next_slots() if self.count_available() >= self.options.min_np else []
        if flags == 0 or upcoming == list(self.slots.values()):
            return
        self.hosts_ts = max(time.time(), self.hosts_ts + 0.001)
        self.keys.set("hosts", json.dumps({"ts": self.hosts_ts, "flags": flags}))

    def wait_for_slots(self, needed: int, what: Callable[[], str], survivors: bool = False) -> None:
        """Discover until ``needed`` slots are available; after ``--elastic-timeout`` the job fails, with a final
        round first where ``survivors`` wait for one (`final_round`)."""
        deadline = time.monotonic() + self.options.elastic_timeout_s
        while self.count_available() < needed:
            if time.monotonic() >= deadline:
                if survivors and self.final_round(what()):
                    return
                self.end(False, what())
            self.reap()
            time.sleep(min(self.interval_s, TICK_S * 4))
            if time.monotonic() >= self.next_discovery:
                self.discover()
                self.next_discovery = time.monotonic() + self.interval_s

    # -- workers -------------------------------------------------------------------------------------------
    def spawn(self, slot: hostrules.Slot) -> None:
        self.spawning = True  # a signal now would leave the worker being started untracked, so alive: defer it
        try:
            self._spawn(slot)
        finally:
            self.spawning = False
        if self.pending_signal is not None:
            self._end_by_signal(self.pending_signal)

    def _spawn(self, slot: hostrules.Slot) -> None:
        old = self.workers.pop(slot.key, None)
        if old is not None:
            self.gone.append(old)
            old.kill()
        env = {**slot.horovod_env(), "HOROVOD_ELASTIC": "1", "HOROVOD_CONTROLLER": "gloo",
               "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1",
               STORE_VARIABLE: self.store_addr, SLOT_VARIABLE: slot.key, VERSION_VARIABLE: str(self.version),
               TIMEOUT_VARIABLE: f"{self.options.elastic_timeout_s:g}"}
        self.workers[slot.key] = self.start(slot, env)

    def final_round(self, line: str) -> bool:
        """Publish a last round of the workers that left the failed one, marked final (``line``), so that they
        write their last commit; False when the next slots are not all theirs (nobody is started for it)."""
        slots = self.next_slots()
        if not slots or any(self.recorded.get(s.key, ("", 0))[0] != "ready" or s.key not in self.workers
                            for s in slots):
            return False
        say(f"{line}: a final round of the {len(slots)} left, to write their last commit")
        self.final = line
        self.publish(slots)
        return True

    def publish(self, slots: Sequence[hostrules.Slot]) -> None:
        self.version += 1
        previous = set(self.slots)
        self.slots = {s.key: s for s in slots}
        for key in previous - set(self.slots):  # removed: it exits 0 by itself when it reads the version
            if key in self.workers:
                self.gone.append(self.workers.pop(key))
        published: dict[str, Any] = {"size": len(slots), "slots": {s.key: s.published() for s in slots}}
        if self.final is not None:
            published["final"] = self.final
        self.keys.set(version_key(self.version), json.dumps(published))
        self.keys.set("version", str(self.version))
        self.recorded = {}
        self.first_record = 0.0
        start = [slot for slot in slots if slot.key not in self.workers]
        self.fresh = {slot.key for slot in start} if self.version > 0 else set()
        for slot in start:
            self.spawn(slot)

    def reap(self) -> None:
        for key, worker in list(self.workers.items()):
            code = worker.poll()
            if code is None or key not in self.slots:
                continue
            state = "success" if code == 0 else "failure"
            if key not in self.recorded or state == "failure":  # died after leaving: the failure wins
                self.recorded[key] = (state, code)
                self.first_record = self.first_record or (time.monotonic() if state == "failure" else 0.0)
        self.gone = [w for w in self.gone if w.poll() is None]

    def check_left(self) -> None:
        for key in self.slots:
            if key not in self.recorded and self.keys.check([left_key(self.version, key)]):
                self.recorded[key] = ("ready", 0)
                self.first_record = self.first_record or time.monotonic()

    def kill_stragglers(self) -> None:
        """A worker stuck in a collective whose peers left the round long ago: SIGKILL releases everyone. A
        worker started to join survivors (a round after the first) gets ``--elastic-timeout`` instead (starting
        may be slow), the others the group timeout + 10 s, counted from the first peer that left or failed."""
        if not self.first_record:
            return
        waited = time.monotonic() - self.first_record
        for key in self.slots:
            worker = self.workers.get(key)
            limit = self.options.elastic_timeout_s if key in self.fresh else self.straggler_s
            if self.final is not None:  # a final round's workers write a checkpoint before they exit
                limit = max(limit, self.options.elastic_timeout_s)
            if key in self.recorded or worker is None or worker.killed or waited < limit or worker.poll() is not None:
                continue
            say(f"{worker.name} did not leave round {self.version} within {limit:g} s after its peers: killed")
            worker.kill()

    def kill_host(self, host: str) -> None:
        for key, worker in list(self.workers.items()):
            if worker.host == host:
                worker.kill()
                self.gone.append(self.workers.pop(key))

    # -- the job ---------------------------------------------------------------------------------------------
    def end(self, ok: bool, line: str | None) -> None:
        if line:
            say(line)
        self.keys.set("end", json.dumps({"ok": ok, "line": line or "done"}))
        raise Ended(0 if ok else 1)

    def stop_all(self) -> None:
        """Let workers waiting for a round see the end, then kill whatever still runs."""
        self.stopping = True
        deadline = time.monotonic() + self.end_grace_s
        live = [w for w in [*self.workers.values(), *self.gone] if w.poll() is None]
        while live and time.monotonic() < deadline:
            time.sleep(TICK_S)
            live = [w for w in live if w.poll() is None]
        for worker in [*self.workers.values(), *self.gone]:
            worker.kill()
            worker.proc.wait()

    def describe(self, key: str) -> str:
        return f"{self.workers[key].name if key in self.workers else key} (rank {self.slots[key].rank})"

    def lost_hosts(self) -> str:
        """The hosts of the last membership that are not available now, each with why."""
        lost = sorted({s.hostname for s in self.slots.values()} - set(self.available()))
        why = {h: self.blacklist.why.get(h, "blacklisted") if self.blacklist.is_out(h) else "no longer discovered"
               for h in lost}
        return ", ".join(f"{h} ({why[h]})" for h in lost) or "none"

    def end_round(self) -> None:
        if self.final is not None:  # the final round's workers wrote their commit (or could not): the end
            self.end(False, self.final)
        states = self.recorded
        failures = [(k, c) for k, (s, c) in states.items() if s == "failure"]
        if any(s == "success" for s, _ in states.values()):
            if failures:
                key, code = failures[0]
                self.end(False, f"{self.describe(key)} failed with exit code {code}")
            self.end(True, None)
        if len(failures) == len(self.slots):
            key, code = failures[0]
            self.end(False, f"every worker failed; the first: {self.describe(key)} with exit code {code}")
        for key, code in failures:
            host = self.slots[key].hostname
            if not self.blacklist.is_out(host):
                cooldown = self.blacklist.add(host, f"blacklisted: {self.describe(key)} exit code {code}")
                say(f"blacklisted host {host}: {self.describe(key)} exited with code {code}"
                    + (f"; back in {cooldown:.1f} s at the earliest" if cooldown else ""))
                self.kill_host(host)
        if all(self.blacklist.is_out(s.hostname) for s in self.slots.values()):
            out = ", ".join(f"{h} (exit code {c})" for h, c in
                            dict((self.slots[k].hostname, c) for k, c in failures).items())
            self.end(False, f"every host is blacklisted: {out}")
        limit = self.options.reset_limit
        if limit is not None and self.resets >= limit:
            self.end(False, f"reset limit {limit} exceeded (Horovod was shutdown because number of resets during "
                            f"elastic job exceeded limit: {limit})")
        self.resets += 1
        self.wait_for_slots(self.options.min_np, lambda: (
            f"min-np {self.options.min_np} not met within --elastic-timeout {self.options.elastic_timeout_s:g} s: "
            f"{self.count_available()} slots available; lost {self.lost_hosts()}"), survivors=True)
        self.publish(self.next_slots())

    def run(self) -> int:
        """The job, start to end; SIGTERM/SIGINT/SIGHUP end it too (every worker stopped), 128 + the signal."""
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stopping:  # stop_all is at it already
            return
        if self.spawning:  # `spawn` ends the job once the worker it starts is tracked
            self.pending_signal = signum
            return
        self._end_by_signal(signum)

    def _end_by_signal(self, signum: int) -> None:
        say(f"stopped by signal {signum}: stopping every worker")
        self.end_grace_s = 0.0
        raise Ended(128 + signum)

    def _run(self) -> int:
        try:
            self.discovery.check()
        except DiscoveryError as exc:
            raise LaunchError(str(exc)) from None
        self.discover(first=True)
        self.next_discovery = time.monotonic() + self.interval_s
        try:
            self.wait_for_slots(self.options.np, lambda: (
                f"-np {self.options.np} slots not found within --elastic-timeout "
                f"{self.options.elastic_timeout_s:g} s: {self.count_available()} available "
                f"({', '.join(f'{h}:{n}' for h, n in self.host_slots.items()) or 'no hosts'})"))
            self.publish(self.next_slots())
            while True:
                if time.monotonic() >= self.next_discovery:
                    self.discover()
                    self.next_discovery = time.monotonic() + self.interval_s
                self.reap()
                self.check_left()
                if len(self.recorded) == len(self.slots):
                    self.end_round()
                else:
                    self.kill_stragglers()
                time.sleep(TICK_S)
        except Ended as ended:
            return ended.code
        finally:
            self.stop_all()


def group_timeout_s(env: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if env is None else env).get("HOROVOD_GLOO_TIMEOUT_SECONDS", "").strip()
    try:
        return float(raw) if raw else 30.0
    except ValueError:
        return 30.0

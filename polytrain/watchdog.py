"""The Trainer's stall inspector: a warning when a rank stops making progress, naming who is behind.

The training loop only bumps a counter and names what it is doing (`Activity`); a
daemon thread does the rest. Once a second it publishes this rank's counter and
activity to a side channel the ranks share (`PeerBoard`, the TCPStore the torch
process group met in), and when the counter has not moved for
``reliability.stall_warning_s`` it prints one warning per stalled activity: what this
rank waits in, for how long, and which ranks have not reached it yet, with what each
of them is doing. Every rank runs the same sequence of activities, so a lower counter
means "behind". Backends without such a channel (MPI, TensorFlow) still get the
warning, without the list of ranks.

The job still fails only through the collective timeout (``reliability.collective_timeout_s``);
the warning comes first, so a hang is explained long before it is ended.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class Activity:
    """What the training loop is doing, as a counter that moves on every change.

    ``set("forward/backward", step=5)`` names a phase of a step; a framework adapter may then
    refine it with ``phase("backward")`` (same step) so a stall says which side of a collective
    each rank is on. ``clock`` stamps each change (seconds; the watchdog reads the same clock).
    """

    def __init__(self, text: str = "start-up", clock: Callable[[], float] = time.monotonic) -> None:
        self.text = text
        self.step: int | None = None
        self.seq = 0
        self.clock = clock
        self.since = clock()

    def set(self, text: str, step: int | None = None) -> None:
        self.step = step
        self.text = text if step is None else f"{text} of step {step}"
        self.seq += 1
        self.since = self.clock()

    def phase(self, name: str) -> None:
        """A finer phase of the current step (``forward``, ``backward``)."""
        self.set(name, self.step)


class PeerBoard(Protocol):
    """Where the ranks post their progress: any key-value store reachable from a thread."""

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None: ...

    def read(self, ranks: range) -> dict[int, tuple[int, str]]: ...

    def beats(self, ranks: range) -> dict[int, int]: ...


class StoreBoard:
    """A `PeerBoard` on a torch.distributed Store (``set`` / ``multi_get`` on keys ``progress/<rank>``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
        self.store.set(f"progress/{rank}", f"{seq}|{beat}|{text}")

    def _entries(self, ranks: range) -> dict[int, tuple[int, int, str]]:
        out = {}
        for rank in ranks:
            if not self.store.check([f"progress/{rank}"]):
                continue
            seq, beat, text = self.store.get(f"progress/{rank}").decode().split("|", 2)
            out[rank] = (int(seq), int(beat), text)
        return out

    def read(self, ranks: range) -> dict[int, tuple[int, str]]:
        return {rank: (seq, text) for rank, (seq, _, text) in self._entries(ranks).items()}

    def beats(self, ranks: range) -> dict[int, int]:
        return {rank: beat for rank, (_, beat, _) in self._entries(ranks).items()}


def hosted_store_board(world: Any, broadcast_object: Callable[[Any], Any]) -> StoreBoard | None:
    """A `StoreBoard` for backends without a store of their own (MPI, TensorFlow's): rank 0 hosts a
    TCPStore on a free port — on loopback when every rank is on this host, else on the address the other
    hosts reach (`polytrain.net.board_address`), never every interface — and sends its address with the
    backend's own ``broadcast_object``. Collective: every rank calls it. None without torch
    (the stall warning then names no ranks).

    The ranks post their progress there from the watchdog's thread, so a rank waiting inside a
    collective that cannot say who is missing still learns which ranks are behind.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    import datetime

    from polytrain.net import board_address, listening_socket

    timeout = datetime.timedelta(seconds=3)
    endpoint, listener = None, None
    if world.rank == 0:
        try:
            host = "127.0.0.1" if world.local_size == world.size else board_address(world.master_addr)
            if host is not None:
                listener = listening_socket(host, 0, max(128, world.size))
                endpoint = (host, listener.getsockname()[1])
        except OSError:  # no address to offer: every rank goes on without a board
            endpoint, listener = None, None
    endpoint = broadcast_object(endpoint)
    if endpoint is None:
        return None
    if listener is not None:
        store = dist.TCPStore(endpoint[0], endpoint[1], world.size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    else:
        store = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timeout, wait_for_workers=False)
    return StoreBoard(dist.PrefixStore("polytrain/watchdog", store))


def stall_message(rank: int, activity: str, seconds: float, peers: dict[int, tuple[int, str]] | None,
                  my_seq: int, size: int, timeout_s: float) -> str:
    """The one warning line for a rank whose ``activity`` has not moved for ``seconds``."""
    head = f"polytrain: rank {rank}: WARNING: no progress in {activity} for {seconds:.0f} s; "
    tail = f" (the job fails after reliability.collective_timeout_s={timeout_s:g} s)"
    if peers is None:
        return head + "this backend cannot tell which ranks are behind" + tail
    behind = sorted(r for r, (seq, _) in peers.items() if seq < my_seq and r != rank)
    silent = sorted(set(range(size)) - set(peers) - {rank})
    parts = [f"rank {r} is still in {peers[r][1]}" for r in behind]
    if silent:
        parts.append(f"no word from rank(s) {', '.join(map(str, silent))}")
    if not parts:
        return head + "every rank has reached it: a collective is slow or stuck, or this rank is busy" + tail
    return head + "; ".join(parts) + tail


class StallWatchdog:
    """A daemon thread that publishes this rank's progress and warns once per stalled activity.

    Time is the activity's ``clock``; ``sleep`` is how `lost_ranks` waits for heartbeats.
    """

    def __init__(self, rank: int, size: int, activity: Activity, warn_after_s: float, timeout_s: float,
                 board: PeerBoard | None, emit: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rank, self.size, self.activity = rank, size, activity
        self.warn_after_s, self.timeout_s = warn_after_s, timeout_s
        self.board = board
        self.emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self.period = min(1.0, warn_after_s / 4)
        self.sleep = sleep
        self._stop = threading.Event()
        self._warned_seq = -1
        self._beat = 0
        self._board_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="polytrain-stall-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it: it may be inside a store call (bounded by the store's timeout),
        and must not be left running into interpreter shutdown or share the store client with a caller."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def close(self) -> None:
        """`stop`, then let go of the side channel: its store client, or on rank 0 of a backend without a store
        of its own the store it hosts (whose server thread ends with it)."""
        self.stop()
        self.board = None

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # the side channel is gone (a peer died, the job ends): the collectives report it
                self.board = None
            if self._stop.wait(self.period):
                return

    def lost_ranks(self) -> dict[int, str] | None:
        """After a collective failed: the ranks whose heartbeat stopped, with what each was last doing.

        Reads every rank's heartbeat, waits a little over two beats and reads again; None when there
        is no side channel or it is gone too (its host, rank 0 or the launcher's agent, went away).
        """
        board = self.board
        if board is None:
            return None
        try:  # this rank keeps beating meanwhile (its thread runs on), so its peers do not count it lost
            with self._board_lock:  # one store client, two threads: one call at a time
                first = board.read(range(self.size))
                before = board.beats(range(self.size))
            self.sleep(2.2 * self.period)
            with self._board_lock:
                after = board.beats(range(self.size))
        except Exception:
            return None
        return {rank: first.get(rank, (0, "nothing: it never reported"))[1] for rank in range(self.size)
                if rank != self.rank and after.get(rank) == before.get(rank)}

    def check(self) -> None:
        seq, text, since = self.activity.seq, self.activity.text, self.activity.since
        if self.board is not None:
            self._beat += 1
            with self._board_lock:
                self.board.publish(self.rank, seq, text, self._beat)
        waited = self.activity.clock() - since
        if waited < self.warn_after_s or seq == self._warned_seq or seq != self.activity.seq:
            return
        self._warned_seq = seq
        with self._board_lock:
            peers = self.board.read(range(self.size)) if self.board is not None else None
        self.emit(stall_message(self.rank, text, waited, peers, seq, self.size, self.timeout_s))


def start_watchdog(backend: Any, rank: int, size: int, activity: Activity, warn_after_s: float,
                   timeout_s: float) -> StallWatchdog | None:
    """The watchdog of a job of ``size`` ranks (None for one rank), on the backend's side channel when it has one
    (without one it still warns, naming no ranks). The Trainer and the own-loop APIs start theirs here."""
    if size == 1:
        return None
    try:
        board = backend.progress_board()
    except (RuntimeError, OSError):  # no side channel (e.g. its store unreachable): warn without naming ranks
        board = None
    return StallWatchdog(rank, size, activity, warn_after_s, timeout_s, board).start()


def who_was_lost(watchdog: StallWatchdog | None) -> str:
    """After a collective failed: which ranks stopped responding (by their heartbeats), or the general cause."""
    lost = watchdog.lost_ranks() if watchdog is not None else None
    if lost:
        return "; ".join(f"rank {rank} stopped responding (last seen in {text})" for rank, text in lost.items())
    return "another rank died, stalled or lost its connection"

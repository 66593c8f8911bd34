"""The Trainer's stall inspector: a warning when a rank stops making progress, naming who is behind; and the
waiting room where ranks wait for a rank that works alone (rank 0 writing a checkpoint), by its heartbeat.

The training loop only bumps a counter and names what it is doing (`Activity`); a
daemon thread does the rest. Once a second it publishes this rank's counter and
activity to a side channel the ranks share (`polytrain.observe.peer_board`: the TCPStore the
torch process group met in), and when the counter has not moved for
``reliability.stall_warning_s`` it prints one warning per stalled activity: what this
rank waits in, for how long, and which ranks have not reached it yet or are in another
activity, with what each of them is doing. Every rank runs the same sequence of
activities, so a lower counter means "behind". Backends without such a channel (MPI,
TensorFlow) get one that rank 0 hosts (`hosted_store_board`); without any, the warning
names no ranks.

The job fails through the collective timeout (``reliability.collective_timeout_s``); the
warning comes first, so a hang is explained long before it is ended. What one rank does
alone is not a collective: `polytrain.comm.settle.settled` runs it, then waits here
(`StallWatchdog.await_peers`) until every rank has done its part, for as long as the ranks
it waits for are alive — their heartbeat moves — and only then meets them in a collective.
A slow disk on rank 0 is no failure; a rank 0 that died is named once its heartbeat has
been still for the collective timeout.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from polytrain.errors import TrainingFailure
from polytrain.observe.peer_board import LEFT, PeerBoard, StoreBoard, hosted_store_board

__all__ = ["LEFT", "Activity", "PeerBoard", "StallWatchdog", "StoreBoard", "hosted_store_board", "stall_message",
           "start_watchdog", "watchdog_of", "who_was_lost"]


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


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _places(rank: int, activity: str, texts: Mapping[int, str]) -> str:
    """``rank 0 is in <activity>, rank 1 in <activity>``: this rank and ``texts``' ranks, in rank order."""
    places = sorted({**texts, rank: activity}.items())
    return ", ".join(f"rank {r} {'is ' if i == 0 else ''}in {text}" for i, (r, text) in enumerate(places))


def stall_message(rank: int, activity: str, seconds: float, peers: dict[int, tuple[int, str]] | None,
                  my_seq: int, size: int, timeout_s: float, *, waiting_for: Sequence[int] = (),
                  working: bool = False) -> str:
    """The one warning line for a rank whose ``activity`` has not moved for ``seconds``.

    ``peers``: every rank's (counter, activity) from the board (None: no board). ``waiting_for``: the ranks this
    one waits for in `StallWatchdog.await_peers` (it has done its own part); ``working``: this rank is still at
    its own part of a `polytrain.comm.settle.settled` exchange (say, writing the checkpoint the others wait for).
    """
    head = f"polytrain: rank {rank}: WARNING: no progress in {activity} for {seconds:.0f} s; "
    tail = f" (the job fails after reliability.collective_timeout_s={timeout_s:g} s)"
    if peers is None:
        return head + "this backend cannot tell which ranks are behind" + tail
    lost_after = f"reliability.collective_timeout_s={timeout_s:g} s"
    if waiting_for:
        waited = list(waiting_for)
        elsewhere = {r: peers[r][1] for r in waited if r in peers and peers[r][1] != activity}
        if elsewhere:
            where = f"{_places(rank, activity, elsewhere)}: this rank waits for {_ranks(waited)} to reach it"
        else:
            where = f"this rank has done its part and waits for {_ranks(waited)}, still at work in it"
        them = "that rank is" if len(waited) == 1 else "those ranks are"
        return (head + f"{where}; it waits as long as {them} alive (the job fails only if a rank stops responding "
                       f"for {lost_after})")
    others = {r: text for r, (seq, text) in peers.items() if r != rank and seq >= my_seq and text != activity}
    if working:
        where = f"{_places(rank, activity, others)}; " if others else ""
        return (head + f"{where}this rank is still at its own part of it, which the other ranks wait for as long "
                       f"as it is alive (the job fails only if a rank stops responding for {lost_after})")
    behind = sorted(r for r, (seq, _) in peers.items() if seq < my_seq and r != rank)
    silent = sorted(set(range(size)) - set(peers) - {rank})
    parts = [f"rank {r} is still in {peers[r][1]}" for r in behind]
    if others:
        parts.append(_places(rank, activity, others))
    if silent:
        parts.append(f"no word from rank(s) {', '.join(map(str, silent))}")
    if not parts:
        return head + "every rank has reached it: a collective is slow or stuck, or this rank is busy" + tail
    return head + "; ".join(parts) + tail


#: The watchdog of each backend's job, for `polytrain.comm.settle.settled` (`watchdog_of`).
_WATCHDOGS: weakref.WeakKeyDictionary[Any, StallWatchdog] = weakref.WeakKeyDictionary()


def watchdog_of(backend: Any) -> StallWatchdog | None:
    """The running watchdog `start_watchdog` started for ``backend``'s job, if any."""
    try:
        return _WATCHDOGS.get(backend)
    except TypeError:  # a backend that cannot be weakly referenced has none
        return None


class StallWatchdog:
    """A daemon thread that publishes this rank's progress and warns once per stalled activity.

    Time is the activity's ``clock``; ``sleep`` is how `lost_ranks` and `await_peers` wait.
    ``quiet_start``: no warning about the activity current when the watchdog starts (the Trainer's start-up,
    which may take long on every rank); the first change arms it.
    """

    def __init__(self, rank: int, size: int, activity: Activity, warn_after_s: float, timeout_s: float,
                 board: PeerBoard | None, emit: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, quiet_start: bool = False) -> None:
        self.rank, self.size, self.activity = rank, size, activity
        self.warn_after_s, self.timeout_s = warn_after_s, timeout_s
        self.board = board
        self.emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self.period = min(1.0, warn_after_s / 4)
        self.sleep = sleep
        self._stop = threading.Event()
        self._warned_seq = activity.seq if quiet_start else -1
        self._beat = 0
        self._board_lock = threading.Lock()
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="polytrain-stall-watchdog", daemon=True)
        #: `polytrain.comm.settle.settled` exchanges this rank has done its part of; the ranks it waits for now;
        #: whether it is inside its own part of one
        self.exchanges = 0
        self.waiting_for: tuple[int, ...] = ()
        self.working = False

    def start(self) -> StallWatchdog:
        """Publish once (so a peer that reaches a `settled` exchange first finds this rank on the board), then
        start the thread."""
        with contextlib.suppress(Exception):
            self.check()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it: it may be inside a store call (bounded by the store's timeout),
        and must not be left running into interpreter shutdown or share the store client with a caller."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def close(self) -> None:
        """`stop`, say on the board that this rank left (a peer waiting for it in `await_peers` stops waiting),
        then let go of the side channel: its store client, or on rank 0 of a backend without a store of its own
        the store it hosts (whose server thread ends with it)."""
        self.stop()
        board, self.board = self.board, None
        if board is not None and self._failing_since is None:  # not to a store gone with its host (rank 0)
            with contextlib.suppress(Exception), self._board_lock:
                board.arrive(self.rank, LEFT)
        for backend, dog in list(_WATCHDOGS.items()):
            if dog is self:
                _WATCHDOGS.pop(backend, None)

    def hush(self) -> None:
        """No warning about the activity this rank is in now (one that is not a stall, whatever its length)."""
        self._warned_seq = self.activity.seq

    def _run(self) -> None:
        while True:
            try:
                self.check()
                self._failing_since = None
            except Exception:  # the side channel failed: a peer gone, or a passing hiccup (a busy store host)
                now = self.activity.clock()
                self._failing_since = self._failing_since if self._failing_since is not None else now
                if now - self._failing_since > self.timeout_s:  # gone for good: the collectives report it
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
        board = self.board
        if board is not None:
            self._beat += 1
            with self._board_lock:
                board.publish(self.rank, seq, text, self._beat)
        waited = self.activity.clock() - since
        if waited < self.warn_after_s or seq == self._warned_seq or seq != self.activity.seq:
            return
        self._warned_seq = seq
        with self._board_lock:
            peers = board.read(range(self.size)) if board is not None else None
        self.emit(stall_message(self.rank, text, waited, peers, seq, self.size, self.timeout_s,
                                waiting_for=self.waiting_for, working=self.working))

    # ------------------------------------------------------------------ the waiting room
    @contextlib.contextmanager
    def own_part(self) -> Iterator[None]:
        """This rank's own part of a `polytrain.comm.settle.settled` exchange (what the stall warning says of it)."""
        self.working = True
        try:
            yield
        finally:
            self.working = False

    def await_peers(self) -> None:
        """After this rank's part of a `polytrain.comm.settle.settled` exchange: post that it is done, then wait
        outside any collective until every rank is, so that the collective that follows does not wait out its
        timeout for a rank still at work (rank 0 writing a checkpoint to a slow disk).

        It waits as long as the ranks it waits for are alive: a rank is given up when its heartbeat (or any word
        from the board) has been still for ``timeout_s`` — then this raises a `TrainingFailure` naming it. Without
        a board, or when a rank it waits for has none (it never reported) or has left the job, it returns at once
        and the collective waits, under its own timeout. Every rank calls this at the same points.
        """
        self.exchanges += 1
        board = self.board
        if board is None:
            return
        try:
            with self._board_lock:
                board.arrive(self.rank, self.exchanges)
        except Exception:
            return
        clock, start = self.activity.clock, self.activity.clock()
        give_up_after = max(self.timeout_s, 5 * self.period)
        pending = [r for r in range(self.size) if r != self.rank]
        pause = min(0.002, self.period)  # a peer that is nearly done is seen at once; a slow one is polled less often
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat, when it last moved)
        texts: dict[int, str] = {}
        try:
            while True:
                beats: dict[int, int] = {}
                try:
                    with self._board_lock:  # a rank that left the job counts as done (`LEFT`)
                        arrived = board.arrivals(pending)
                        pending = [r for r in pending if arrived.get(r, 0) < self.exchanges]
                        beats = board.beats(pending)
                        texts.update((r, text) for r, (_, text) in board.read(pending).items())
                    if any(r not in beats for r in pending):
                        return  # a rank without the side channel: the collective waits for it, as before
                except Exception:  # no word this time (a busy or vanished store): the clock runs on
                    beats = {}
                if not pending:
                    return
                now = clock()
                for r, beat in beats.items():
                    if seen.get(r, (None,))[0] != beat:
                        seen[r] = (beat, now)
                lost = [r for r in pending if now - seen.get(r, (None, start))[1] >= give_up_after]
                if lost:
                    raise TrainingFailure(self._lost_line(lost, texts, give_up_after))
                self.waiting_for = tuple(pending)
                self.sleep(pause)
                pause = min(2 * pause, self.period)
        finally:
            self.waiting_for = ()

    def _lost_line(self, lost: list[int], texts: Mapping[int, str], seconds: float) -> str:
        last = "; ".join(f"rank {r} last seen in {texts.get(r, 'nothing: the side channel did not answer')}"
                         for r in lost)
        return (f"rank {self.rank}: waiting for {_ranks(lost)} during {self.activity.text}: "
                f"{_ranks(lost)} stopped responding ({last}; no heartbeat for {seconds:g} s: "
                f"reliability.collective_timeout_s)")


def start_watchdog(backend: Any, rank: int, size: int, activity: Activity, warn_after_s: float,
                   timeout_s: float, quiet_start: bool = False) -> StallWatchdog | None:
    """The watchdog of a job of ``size`` ranks (None for one rank), on the backend's side channel when it has one
    (without one it still warns, naming no ranks). The Trainer and the own-loop APIs start theirs here; until it
    closes, `polytrain.comm.settle.settled` on ``backend`` waits for slow ranks through it (`watchdog_of`)."""
    if size == 1:
        return None
    try:
        board = backend.progress_board()
    except (RuntimeError, OSError):  # no side channel (e.g. its store unreachable): warn without naming ranks
        board = None
    dog = StallWatchdog(rank, size, activity, warn_after_s, timeout_s, board, quiet_start=quiet_start)
    with contextlib.suppress(TypeError):  # a backend that cannot be weakly referenced: settled waits as before
        _WATCHDOGS[backend] = dog
    return dog.start()


def who_was_lost(watchdog: StallWatchdog | None) -> str:
    """After a collective failed: which ranks stopped responding (by their heartbeats), or the general cause."""
    lost = watchdog.lost_ranks() if watchdog is not None else None
    if lost:
        return "; ".join(f"rank {rank} stopped responding (last seen in {text})" for rank, text in lost.items())
    return "another rank died, stalled or lost its connection"

"""The stall inspector's decisions and wording (the multi-process behaviour is in multiproc/test_peer_failures)."""

from __future__ import annotations

import threading

import pytest

from polytrain.comm.settle import settled
from polytrain.errors import TrainingFailure
from polytrain.loop.watch import LoopWatch
from polytrain.observe.watchdog import (
    LEFT,
    Activity,
    StallWatchdog,
    stall_message,
    start_watchdog,
    watchdog_of,
)


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Board:
    def __init__(self, peers: dict[int, tuple[int, str]]) -> None:
        self.peers = dict(peers)
        self.beat_values = {rank: 0 for rank in peers}
        self.arrived: dict[int, int] = {}

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
        self.peers[rank] = (seq, text)
        self.beat_values[rank] = beat

    def read(self, ranks) -> dict[int, tuple[int, str]]:
        return {r: v for r, v in self.peers.items() if r in ranks}

    def beats(self, ranks) -> dict[int, int]:
        return {r: v for r, v in self.beat_values.items() if r in ranks}

    def arrive(self, rank: int, count: int) -> None:
        self.arrived[rank] = count

    def arrivals(self, ranks) -> dict[int, int]:
        return {r: v for r, v in self.arrived.items() if r in ranks}

    def tick(self, *ranks: int) -> None:
        """The heartbeats of ``ranks`` move (those ranks are alive)."""
        for rank in ranks:
            self.beat_values[rank] = self.beat_values.get(rank, 0) + 1


def test_activity_counts_changes_and_keeps_the_step_for_phases() -> None:
    clock = Clock()
    activity = Activity(clock=clock)
    clock.now += 5
    activity.set("forward/backward", step=3)
    activity.phase("backward")
    assert (activity.text, activity.step, activity.seq, activity.since) == ("backward of step 3", 3, 2, 1005.0)


def test_message_names_ranks_behind_and_silent_ones() -> None:
    peers = {0: (9, "backward of step 5"), 1: (7, "forward of step 5"), 3: (9, "backward of step 5")}
    text = stall_message(0, "backward of step 5", 12.4, peers, 9, 4, 300)
    assert text == ("polytrain: rank 0: WARNING: no progress in backward of step 5 for 12 s; rank 1 is still in "
                    "forward of step 5; no word from rank(s) 2 (the job fails after "
                    "reliability.collective_timeout_s=300 s)")
    assert "every rank has reached it" in stall_message(1, "x", 5, {0: (9, "x"), 1: (9, "x")}, 9, 2, 60)
    assert "cannot tell which ranks are behind" in stall_message(1, "x", 5, None, 9, 2, 60)


def test_warns_once_per_stalled_activity_and_publishes_progress() -> None:
    clock, lines = Clock(), []
    activity = Activity(clock=clock)
    activity.set("forward/backward", step=1)
    board = Board({1: (0, "data")})
    dog = StallWatchdog(0, 2, activity, warn_after_s=10, timeout_s=300, board=board, emit=lines.append)
    dog.check()
    assert lines == [] and board.peers[0] == (1, "forward/backward of step 1")
    clock.now += 9.9  # not yet
    dog.check()
    assert lines == []
    clock.now += 0.1  # exactly warn_after_s since the activity began
    dog.check()
    clock.now += 30
    dog.check()  # the same activity: no second warning
    assert lines == ["polytrain: rank 0: WARNING: no progress in forward/backward of step 1 for 10 s; rank 1 is "
                     "still in data (the job fails after reliability.collective_timeout_s=300 s)"]
    activity.phase("backward")
    clock.now += 12.4
    dog.check()
    assert len(lines) == 2 and "no progress in backward of step 1 for 12 s; rank 1 is still in data" in lines[1]
    assert board.beat_values[0] == 5  # every check published a heartbeat


def test_a_rank_without_a_board_still_warns() -> None:
    clock, lines = Clock(), []
    activity = Activity(clock=clock)
    dog = StallWatchdog(1, 2, activity, warn_after_s=2, timeout_s=60, board=None, emit=lines.append)
    clock.now += 3
    dog.check()
    assert len(lines) == 1 and "start-up for 3 s; this backend cannot tell which ranks are behind" in lines[0]


def test_lost_ranks_are_those_whose_heartbeat_stopped() -> None:
    board = Board({0: (5, "backward of step 2"), 1: (4, "forward of step 2"), 2: (5, "backward of step 2")})
    waits = []

    def sleep(seconds: float) -> None:  # while the watchdog waits, ranks 0 and 2 beat; rank 1 is gone
        waits.append(seconds)
        board.tick(0, 2)

    dog = StallWatchdog(0, 4, Activity(), warn_after_s=4, timeout_s=300, board=board, sleep=sleep)
    assert dog.lost_ranks() == {1: "forward of step 2", 3: "nothing: it never reported"}
    assert waits == [2.2]  # a little over two heartbeats (one per second at most)
    assert StallWatchdog(0, 3, Activity(), warn_after_s=4, timeout_s=300, board=None).lost_ranks() is None


def test_lost_ranks_is_empty_when_every_heartbeat_moves() -> None:
    board = Board({0: (5, "x"), 1: (5, "x")})
    dog = StallWatchdog(1, 2, Activity(), warn_after_s=4, timeout_s=300, board=board, sleep=lambda _: board.tick(0, 1))
    assert dog.lost_ranks() == {}


# ---------------------------------------------------------------------- ranks in different activities (issue 48)
def test_message_names_what_each_rank_does_when_their_activities_differ() -> None:
    """An own loop that saves on rank 0 only: rank 0 is in the save, rank 1 in backward, with the same counter."""
    text = stall_message(1, "backward of step 4", 61, {0: (12, "the checkpoint save"), 1: (12, "backward of step 4")},
                         12, 2, 300)
    assert text == ("polytrain: rank 1: WARNING: no progress in backward of step 4 for 61 s; rank 0 is in the "
                    "checkpoint save, rank 1 in backward of step 4 (the job fails after "
                    "reliability.collective_timeout_s=300 s)")
    # a rank ahead, in another activity, is named the same way; one behind still as behind
    text = stall_message(0, "x", 5, {0: (9, "x"), 1: (7, "y"), 2: (10, "z")}, 9, 3, 60)
    assert "; rank 1 is still in y; rank 0 is in x, rank 2 in z (the job" in text
    assert "every rank has reached it" not in text


def test_message_of_a_rank_waiting_for_a_writer_says_for_whom_and_how_long() -> None:
    peers = {0: (7, "the checkpoint at step 3"), 1: (7, "the checkpoint at step 3")}
    text = stall_message(1, "the checkpoint at step 3", 12, peers, 7, 2, 10, waiting_for=(0,))
    assert text == ("polytrain: rank 1: WARNING: no progress in the checkpoint at step 3 for 12 s; this rank has done "
                    "its part and waits for rank 0, still at work in it; it waits as long as that rank is alive (the "
                    "job fails only if a rank stops responding for reliability.collective_timeout_s=10 s)")
    # the writer's own warning: it is at its part, which the others wait for
    text = stall_message(0, "the checkpoint at step 3", 12, peers, 7, 2, 10, working=True)
    assert text == ("polytrain: rank 0: WARNING: no progress in the checkpoint at step 3 for 12 s; this rank is still "
                    "at its own part of it, which the other ranks wait for as long as it is alive (the job fails only "
                    "if a rank stops responding for reliability.collective_timeout_s=10 s)")
    # waiting for a rank that is somewhere else (a save only rank 0 makes)
    text = stall_message(0, "the checkpoint save", 3, {1: (12, "backward of step 4")}, 12, 2, 300, waiting_for=(1,))
    assert ("; rank 0 is in the checkpoint save, rank 1 in backward of step 4: this rank waits for rank 1 to reach "
            "it; it waits as long as that rank is alive") in text


def test_the_watchdog_warns_with_what_it_waits_for() -> None:
    clock, lines = Clock(), []
    activity = Activity(clock=clock)
    activity.set("the checkpoint at step 3")
    board = Board({0: (1, "the checkpoint at step 3")})
    dog = StallWatchdog(1, 2, activity, warn_after_s=2, timeout_s=10, board=board, emit=lines.append)
    dog.waiting_for = (0,)
    clock.now += 2
    dog.check()
    assert len(lines) == 1 and "this rank has done its part and waits for rank 0, still at work in it" in lines[0]


def test_a_quiet_start_warns_only_once_the_activity_changed() -> None:
    clock, lines = Clock(), []
    activity = Activity(clock=clock)
    dog = StallWatchdog(0, 2, activity, warn_after_s=2, timeout_s=10, board=None, emit=lines.append, quiet_start=True)
    clock.now += 30
    dog.check()
    assert lines == []  # start-up is long on every rank (building, compiling): not a stall
    activity.set("the start of the training loop")
    clock.now += 3
    dog.check()
    assert len(lines) == 1 and "no progress in the start of the training loop for 3 s" in lines[0]


# ---------------------------------------------------------------------- waiting for a rank at work alone
class Peers:
    """A board on which rank 0 (the writer) beats while the waiting rank sleeps, and arrives once ``arrive_after``
    seconds have passed since the first sleep (or never), or stops beating."""

    def __init__(self, board: Board, clock: Clock, *, arrive_after: float | None, beating: bool = True) -> None:
        self.board, self.clock, self.arrive_after, self.beating, self.sleeps = board, clock, arrive_after, beating, []
        self.start = clock.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.now += seconds
        if self.beating:
            self.board.tick(0)
        if self.arrive_after is not None and self.clock.now - self.start >= self.arrive_after:
            self.board.arrive(0, 1)


def waiting_rank(board: Board, clock: Clock, sleep, timeout_s: float = 10) -> StallWatchdog:
    activity = Activity(clock=clock)
    activity.set("the checkpoint at step 3")
    return StallWatchdog(1, 2, activity, warn_after_s=4, timeout_s=timeout_s, board=board, sleep=sleep)


def test_a_rank_waits_for_a_slow_writer_as_long_as_its_heartbeat_moves() -> None:
    clock, board = Clock(), Board({0: (1, "the checkpoint at step 3")})
    peers = Peers(board, clock, arrive_after=100)  # 100 s of writing, ten times the collective timeout
    dog = waiting_rank(board, clock, peers.sleep)
    dog.await_peers()
    assert board.arrived[1] == 1 and dog.exchanges == 1  # this rank posted its part first
    assert 1100.0 <= clock.now < 1101.0 and dog.waiting_for == ()  # seen within one period of its arrival
    # it polls at once, then backs off to the watchdog's period: a peer that is nearly done costs no full period
    assert peers.sleeps[0] == 0.002 and max(peers.sleeps) == dog.period == 1.0


def test_a_writer_whose_heartbeat_stops_is_named_after_the_collective_timeout() -> None:
    clock, board = Clock(), Board({0: (1, "the checkpoint at step 3")})
    peers = Peers(board, clock, arrive_after=None, beating=False)  # SIGKILLed mid-write
    dog = waiting_rank(board, clock, peers.sleep)
    with pytest.raises(TrainingFailure) as error:
        dog.await_peers()
    assert str(error.value) == ("rank 1: waiting for rank 0 during the checkpoint at step 3: rank 0 stopped "
                                "responding (rank 0 last seen in the checkpoint at step 3; no heartbeat for 10 s: "
                                "reliability.collective_timeout_s)")
    assert 1010.0 <= clock.now < 1011.0  # the collective timeout after it last beat (here: since the wait began)


def test_a_side_channel_that_vanished_with_the_writer_names_it_after_the_timeout() -> None:
    """Rank 0 hosts the store (the local launcher's, MPI's board): when it dies every read fails."""
    clock, board = Clock(), Board({0: (1, "the checkpoint at step 3")})
    dog = waiting_rank(board, clock, lambda s: setattr(clock, "now", clock.now + s))
    reads = []

    def gone(ranks) -> dict[int, int]:
        reads.append(1)
        if len(reads) > 1:
            raise RuntimeError("Connection reset by peer")
        return {}

    board.arrivals = gone  # the first read works, then the store is gone
    with pytest.raises(TrainingFailure, match=r"^rank 1: waiting for rank 0 during the checkpoint at step 3: rank 0 "
                                              r"stopped responding \(rank 0 last seen in the checkpoint at step 3"):
        dog.await_peers()


def test_no_wait_for_a_rank_without_a_board_or_one_that_left() -> None:
    clock = Clock()
    board = Board({})  # rank 0 never reported: it has no side channel, so the collective waits for it as before
    waiting_rank(board, clock, lambda s: pytest.fail("waited")).await_peers()
    board = Board({0: (1, "x")})
    board.arrive(0, LEFT)  # rank 0 left the job (its watchdog closed): the collective reports it
    waiting_rank(board, clock, lambda s: pytest.fail("waited")).await_peers()
    dog = StallWatchdog(1, 2, Activity(), warn_after_s=4, timeout_s=10, board=None)
    dog.await_peers()
    assert dog.exchanges == 1  # counted all the same: every rank numbers the exchanges alike


class Recorder:
    """A backend's object collective, recorded (a one-rank job's gather: only the order of calls is tested)."""

    def __init__(self, board: Board) -> None:
        self.board, self.calls = board, []

    def progress_board(self) -> Board:
        return self.board

    def all_gather_object(self, obj):
        self.calls.append(("all_gather", dict(self.board.arrived)))
        return [None, obj]


def test_settled_waits_on_the_board_before_its_collective_and_closes_cleanly() -> None:
    board = Board({0: (1, "the checkpoint at step 3")})
    board.arrive(0, 1)  # rank 0 wrote and posted its part
    backend = Recorder(board)
    dog = start_watchdog(backend, 1, 2, Activity(), warn_after_s=60, timeout_s=10)
    assert watchdog_of(backend) is dog
    seen = []
    assert settled(backend, 2, lambda: seen.append(dog.working) or "mine") == "mine"
    assert seen == [True] and not dog.working
    assert backend.calls == [("all_gather", {0: 1, 1: 1})]  # this rank posted its part before the collective
    dog.close()
    assert watchdog_of(backend) is None and board.arrived[1] == LEFT
    assert not any(t.name == "polytrain-stall-watchdog" and t.is_alive() for t in threading.enumerate())


def test_a_loop_that_names_only_its_saves_is_warned_about_in_them_only() -> None:
    """TensorFlow's own loop names only save and load: the training between them is no stall, however long."""
    clock, lines = Clock(), []
    watch = LoopWatch(0, 2, between="the script's own code")
    watch.activity = Activity(clock=clock)
    watch.start(Recorder(Board({})), stall_warning_s=2, collective_timeout_s=10)
    dog = watch.watchdog
    dog.stop()  # checked by hand below, on the test's clock
    dog.emit = lines.append
    clock.now += 30
    dog.check()
    with watch.during("the checkpoint save"):
        clock.now += 3
        dog.check()
    clock.now += 30
    dog.check()
    watch.close()
    assert len(lines) == 1 and "no progress in the checkpoint save for 3 s" in lines[0]
    assert watch.activity.text == "the script's own code"

"""The stall inspector's decisions and wording (the multi-process behaviour is in multiproc/test_peer_failures)."""

from __future__ import annotations

from polytrain.watchdog import Activity, StallWatchdog, stall_message


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

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
        self.peers[rank] = (seq, text)
        self.beat_values[rank] = beat

    def read(self, ranks: range) -> dict[int, tuple[int, str]]:
        return {r: v for r, v in self.peers.items() if r in ranks}

    def beats(self, ranks: range) -> dict[int, int]:
        return {r: v for r, v in self.beat_values.items() if r in ranks}

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

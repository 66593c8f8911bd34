"""The stall inspector's decisions and wording (the multi-process behaviour is in multiproc/test_peer_failures)."""

from __future__ import annotations

import time

from polytrain.watchdog import Activity, StallWatchdog, stall_message


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
        for rank in (0, 2):  # ranks 0 and 2 are alive and keep beating; rank 1 is gone
            self.beat_values[rank] = self.beat_values.get(rank, 0) + 1
        return {r: v for r, v in self.beat_values.items() if r in ranks}


def test_activity_counts_changes_and_keeps_the_step_for_phases() -> None:
    activity = Activity()
    activity.set("forward/backward", step=3)
    activity.phase("backward")
    assert (activity.text, activity.step, activity.seq) == ("backward of step 3", 3, 2)


def test_message_names_ranks_behind_and_silent_ones() -> None:
    peers = {0: (9, "backward of step 5"), 1: (7, "forward of step 5"), 3: (9, "backward of step 5")}
    text = stall_message(0, "backward of step 5", 12.4, peers, 9, 4, 300)
    assert text == ("polytrain: rank 0: WARNING: no progress in backward of step 5 for 12 s; rank 1 is still in "
                    "forward of step 5; no word from rank(s) 2 (the job fails after "
                    "reliability.collective_timeout_s=300 s)")
    assert "every rank has reached it" in stall_message(1, "x", 5, {0: (9, "x"), 1: (9, "x")}, 9, 2, 60)
    assert "cannot tell which ranks are behind" in stall_message(1, "x", 5, None, 9, 2, 60)


def test_warns_once_per_stalled_activity_and_publishes_progress() -> None:
    activity, lines = Activity(), []
    activity.set("forward/backward", step=1)
    board = Board({1: (0, "data")})
    dog = StallWatchdog(0, 2, activity, warn_after_s=0.05, timeout_s=300, board=board, emit=lines.append)
    dog.check()
    assert lines == [] and board.peers[0] == (1, "forward/backward of step 1")
    time.sleep(0.06)
    dog.check()
    dog.check()
    assert len(lines) == 1 and "rank 1 is still in data" in lines[0]
    activity.phase("backward")
    time.sleep(0.06)
    dog.check()
    assert len(lines) == 2 and "no progress in backward of step 1" in lines[1]


def test_lost_ranks_are_those_whose_heartbeat_stopped() -> None:
    activity = Activity()
    board = Board({1: (4, "forward of step 2"), 2: (5, "backward of step 2")})
    dog = StallWatchdog(0, 3, activity, warn_after_s=0.04, timeout_s=300, board=board)
    assert dog.lost_ranks() == {1: "forward of step 2"}
    assert StallWatchdog(0, 3, activity, warn_after_s=0.04, timeout_s=300, board=None).lost_ranks() is None

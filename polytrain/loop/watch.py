"""Stall warnings and the failure report for a hand-written loop (the own-loop APIs), as the Trainer has them.

The Trainer names what it is doing in a `polytrain.observe.watchdog.Activity` and runs a `StallWatchdog` beside its
loop; when a collective fails because a peer is gone, it says which rank stopped responding. A user's loop
has no such places of its own, but every call it makes into the own-loop API is one: `LoopWatch.during` names
the activity (``backward of step 5``, ``the optimizer step of step 5``, ``all_reduce``, ...) and turns a
collective that failed inside it into a `TrainingFailure` naming the lost rank(s), from the watchdog's
heartbeats. A rank that stops making progress for ``reliability.stall_warning_s`` is warned about on the
waiting ranks, naming who is behind and where, exactly as in the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from polytrain.errors import TrainingFailure, is_peer_failure, peer_failure_detail
from polytrain.observe.watchdog import Activity, StallWatchdog, start_watchdog, who_was_lost


class LoopWatch:
    """This rank's activity and, on more than one rank, the stall watchdog reading it.

    ``between``: for an API that does not name every call of a training step (TensorFlow's: the gradients are
    averaged inside the script's compiled step), what the activity says between the calls it names — with no
    stall warning about it, which would only say that the script trains on.
    """

    def __init__(self, rank: int, size: int, *, between: str | None = None) -> None:
        self.rank, self.size, self.between = rank, size, between
        self.activity = Activity()
        self.watchdog: StallWatchdog | None = None

    def start(self, backend: Any, stall_warning_s: float, collective_timeout_s: float) -> None:
        """Start the watchdog (after the backend's setup: its side channel is the rendezvous store); from here on,
        what one rank does alone in a save or load (`polytrain.comm.settle.settled`) is waited for by the others."""
        if self.watchdog is None:
            self.activity.set(self.between or "the start of the loop")
            self.watchdog = start_watchdog(backend, self.rank, self.size, self.activity, stall_warning_s,
                                           collective_timeout_s, quiet_start=self.between is not None)

    @contextlib.contextmanager
    def during(self, text: str, step: int | None = None) -> Iterator[None]:
        """Name what this rank does now; a collective failing inside becomes one line naming the lost rank(s)."""
        self.activity.set(text, step)
        try:
            yield
        except TrainingFailure:
            raise
        except Exception as exc:
            if self.size == 1 or not is_peer_failure(exc):
                raise
            raise TrainingFailure(f"rank {self.rank}: a collective failed during {self.activity.text}: "
                                  f"{who_was_lost(self.watchdog)} ({peer_failure_detail(exc)})") from exc
        finally:
            if self.between is not None:
                self.activity.set(self.between)
                if self.watchdog is not None:
                    self.watchdog.hush()

    def phase(self, name: str) -> None:
        """A finer phase of the current step (``backward``)."""
        self.activity.phase(name)

    def close(self) -> None:
        """Stop the watchdog's thread and let go of its side channel."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.close()

"""A callback for the preemption tests (``callbacks: [signal_at:SignalAt]``, this directory on PYTHONPATH): at the
end of each step in ``SIGNAL_AT`` (a comma list) it sends ``SIGNAL_NAME`` (SIGTERM by default), a real signal, on
the ranks ``SIGNAL_RANKS`` names (``all``, or a comma list; rank 0 by default), to its own process or, with
``SIGNAL_TARGET=parent``, to its parent (torchrun's agent, which passes it on to every rank, as a pod's SIGTERM
reaches them), or with ``SIGNAL_TARGET=launch`` to its parent's parent (`polytrain launch`, above mpirun). ``SIGNAL_SLOW``: seconds each step takes longer once the signal is sent (a stop that cannot end in
its grace time). Without ``SIGNAL_AT`` it does nothing (the resumed run)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


class SignalAt:
    def __init__(self) -> None:
        self.at = {int(step) for step in os.environ.get("SIGNAL_AT", "").split(",") if step}
        self.signal = signal.Signals[os.environ.get("SIGNAL_NAME", "SIGTERM")]
        self.ranks = os.environ.get("SIGNAL_RANKS", "0")
        self.to = os.environ.get("SIGNAL_TARGET", "self")
        self.slow = float(os.environ.get("SIGNAL_SLOW", "0"))
        self.sent = False

    def target(self) -> int:
        """This process, its parent, or its parent's parent (``launch``: `polytrain launch` above mpirun)."""
        if self.to == "self":
            return os.getpid()
        if self.to == "parent":
            return os.getppid()
        with open(f"/proc/{os.getppid()}/stat") as stat:  # "pid (name) state ppid ...": the name may hold spaces
            return int(stat.read().rpartition(")")[2].split()[1])

    def on_step_end(self, run: Any, step: int, logs: dict[str, Any]) -> None:
        if step in self.at and (self.ranks == "all" or str(run.rank) in self.ranks.split(",")):
            os.kill(self.target(), self.signal)
            self.sent = True
        elif self.sent and self.slow:
            time.sleep(self.slow)

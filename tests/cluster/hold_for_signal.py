"""A callback for the Slurm preemption tests (``callbacks: [hold_for_signal:HoldForSignal]``, this directory on
PYTHONPATH): at the end of step ``HOLD_AT`` every rank writes ``HOLD_DIR/rank<r>`` and waits until its own
process has got a signal of the run's ``preemption`` table (the test sends it through Slurm once every rank is
there), so the signal always lands mid-run, at a known step, however fast or slow the machine is. A hang guard
ends the wait after ``HOLD_TIMEOUT_S`` (default 120) with an error. A resumed run starts past ``HOLD_AT``: no
hold."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class HoldForSignal:
    def __init__(self) -> None:
        self.at = int(os.environ.get("HOLD_AT", "-1"))
        self.dir = Path(os.environ.get("HOLD_DIR", "."))
        self.timeout_s = float(os.environ.get("HOLD_TIMEOUT_S", "120"))

    def on_step_end(self, run: Any, step: int, logs: dict[str, Any]) -> None:
        if step != self.at:
            return
        (self.dir / f"rank{run.rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + self.timeout_s
        while run.preempt_signal is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {run.rank}: no signal within {self.timeout_s:g} s at step {step}")
            time.sleep(0.05)

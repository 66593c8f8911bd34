"""A signal stops the run at a step boundary every rank agrees on (the spec's ``preemption`` table, issue 52).

A rank that gets one of the table's signals only notes it (the handler does nothing else: no save, no collective
inside a signal handler). The ranks agree without a collective of their own: the note rides in the one the
Trainer already makes when a logging window closes (the window's loss sums are all-reduced, every
``loop.log_every_n_steps`` steps and at each epoch's end), as one more number, the count of ranks that were
signalled. Every rank reads the same count after the same step, so every rank stops there: at the first window
close after the signal, none past it, none before. The Trainer then leaves its loop, saves a checkpoint at that
step (settled before the exit), and ends with `Preempted`: exit code `PREEMPTED_EXIT`, resumable with
``--resume auto``, and under Slurm with ``requeue: auto`` the job requeued (`request_requeue`).

``grace_s`` bounds the whole stop: when it runs out first, the process ends with the same code and a last line
saying that the newest complete checkpoint is still the one to resume from (a checkpoint is written aside and
renamed into place, so one cut off stays invisible). A second signal during the stop changes nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from os import _exit
from typing import Any

from polytrain.errors import Preempted
from polytrain.spec.preemption import PREEMPTED_EXIT, PreemptionSpec, check_requeue, signal_numbers


class StepStop:
    """A run's stop at an agreed step boundary; `NO_STOP` where the spec has no ``preemption`` table."""

    def __init__(self, spec: PreemptionSpec | None, rank: int,
                 emit: Callable[[str], None] | None = None, exit_now: Callable[[int], None] = _exit) -> None:
        self.spec, self.rank = spec, rank
        self.emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self.exit_now = exit_now
        self.signal: str | None = None  # the signal this rank got
        self.stop_step: int | None = None  # the agreed step, once known
        self.stopped_at: int | None = None  # the step the run stopped after
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None
        self.checkpoint_dir: Any = "checkpoint.dir"  # named when the grace time runs out

    def install(self, checkpoint_dir: Any = "checkpoint.dir", environ: Mapping[str, str] = os.environ) -> StepStop:
        """Handle the table's signals from now on (main thread only: elsewhere a line says they are not)."""
        if self.spec is None:
            return self
        self.checkpoint_dir = checkpoint_dir
        check_requeue(self.spec, environ)
        try:
            for number in signal_numbers(self.spec.signals):
                self._previous[number] = signal.signal(number, self._on_signal)
        except ValueError:  # not the main thread (polytrain.fit from a thread of the caller's)
            self.close()
            self.emit("polytrain: preemption: signals are handled only when training runs in the main thread")
        return self

    def _on_signal(self, number: int, _frame: Any) -> None:
        if self.signal is not None:  # a second signal during the stop: noted by the first, nothing more
            return
        self.signal = signal.Signals(number).name
        self._timer = threading.Timer(self.spec.grace_s, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        self.emit(f"polytrain: rank {self.rank}: preempted by {self.signal}: the stop did not end within "
                  f"preemption.grace_s={self.spec.grace_s:g} s; the newest complete checkpoint in {self.checkpoint_dir} "
                  f"stays the one to resume from (exit code {PREEMPTED_EXIT})")
        self.exit_now(PREEMPTED_EXIT)

    @property
    def asked(self) -> float:
        """What this rank adds to the window's all-reduce: 1 when it was signalled."""
        return 1.0 if self.signal is not None else 0.0

    def heard(self, signalled: float, step: int) -> None:
        """The reduced count of signalled ranks at the window that closed after ``step``: the same on every rank."""
        if signalled > 0 and self.stop_step is None:
            self.stop_step = step

    def due(self, step: int) -> bool:
        """At the boundary after ``step``: whether the run stops here (a flag test)."""
        if self.stop_step is not None and step >= self.stop_step:
            self.stopped_at = step
            return True
        return False

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def end(self, saved_step: int | None, environ: Mapping[str, str] = os.environ,
            resume: str = "resume with --resume auto") -> Preempted:
        """After the stop's checkpoint has settled (``saved_step``: its step, None where the caller's loop saved):
        requeue where asked (rank 0), and the `Preempted` to raise (rank 0's is shown)."""
        if self._timer is not None:
            self._timer.cancel()
        requeued = request_requeue(self.spec.requeue, environ) if self.rank == 0 else ""
        who = self.signal or "a signal to another rank"
        saved = "" if saved_step is None else f", its checkpoint written at step {saved_step}"
        return Preempted(f"preempted by {who}: every rank stopped after step {self.stopped_at}{saved}; "
                         f"{resume}{requeued}", show=self.rank == 0)

    def close(self) -> None:
        """No grace timer (the stop ended in time), and the previous handlers back, unless the run stopped: then
        this process is on its way out with `PREEMPTED_EXIT`, and a signal that comes meanwhile changes nothing
        (under torchrun, the agent SIGTERMs the ranks still tearing down once the first has exited). The signals
        are then ignored, not handled: Python puts the default action back for its own handlers when it
        finalises, and a SIGTERM then would still end the process as killed (-15) instead of with its code."""
        if self._timer is not None:
            self._timer.cancel()
        if self.stopped:
            for number in self._previous:
                signal.signal(number, signal.SIG_IGN)
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()


def request_requeue(requeue: str, environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which,
                    run: Callable[..., Any] = subprocess.run) -> str:
    """Ask Slurm to requeue this job (``requeue`` auto or always, under Slurm): ``scontrol requeue`` where it is
    reachable, else leave it to the exit code (Slurm's ``RequeueExit``). What was done, as the end of a line."""
    job = environ.get("SLURM_JOB_ID")
    if requeue == "never" or not job:
        return ""
    scontrol = which("scontrol")
    if scontrol is None:
        return (f"; scontrol is not reachable here (a container?): Slurm requeues the job on exit code "
                f"{PREEMPTED_EXIT} where RequeueExit names it")
    try:
        done = run([scontrol, "requeue", job], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"; scontrol requeue {job} failed ({exc})"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        if "pending execution" in said:  # the scheduler's own requeue (scontrol requeue, preemption) came first
            return f"; Slurm job {job} was requeued already"
        return f"; scontrol requeue {job} failed: {said[:200]}"
    return f"; Slurm job {job} requeued"


NO_STOP = StepStop(None, 0)


def start_stop(spec: PreemptionSpec | None, rank: int, checkpoint_dir: Any) -> StepStop:
    """A run's `StepStop`, its signals handled from now on (`NO_STOP` without a ``preemption`` table)."""
    return StepStop(spec, rank).install(checkpoint_dir) if spec is not None else NO_STOP

"""The ``preemption`` table: a signal stops the run at a step boundary every rank agrees on, with a checkpoint
there, instead of killing it wherever it is (issue 52).

``preemption: {signals: [SIGTERM, SIGUSR1], requeue: auto|never|always, grace_s: 120}``. A run with the table
handles those signals (`polytrain.train.preemption`); without it a signal ends the ranks as before. ``requeue``:
``auto`` asks Slurm to requeue the job where it runs under Slurm (``scontrol requeue``, or where ``scontrol`` is not
reachable, the exit code `PREEMPTED_EXIT` for Slurm's ``RequeueExit``); ``never`` only stops; ``always`` is
``auto`` that refuses to start outside a scheduler that can requeue. ``grace_s`` bounds the whole stop, from the
signal to the exit.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.errors import Preempted, SpecError
from polytrain.spec.schema import rule

#: the exit code of a run stopped by a signal, resumable (sysexits' EX_TEMPFAIL: "try again later")
PREEMPTED_EXIT = Preempted.exit_code
#: signals a run cannot take over: SIGKILL and SIGSTOP are never delivered to a handler, SIGINT is Ctrl-C's
UNHANDLED = ("SIGKILL", "SIGSTOP", "SIGINT")


@dataclass(frozen=True)
class PreemptionSpec:
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")  # what Slurm, Kubernetes and spot notices send
    requeue: str = rule("auto", choices=("auto", "never", "always"))
    grace_s: float = rule(120.0, min=0.0, min_exclusive=True)  # from the signal to the exit, save included


def signal_numbers(names: tuple[str, ...]) -> list[signal.Signals]:
    """The signals named (``SIGTERM``, ``TERM``, any case), or `SpecError` naming the field and what is allowed."""
    found = []
    for i, name in enumerate(names):
        key = str(name).upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        if key in UNHANDLED or key not in signal.Signals.__members__:
            allowed = ", ".join(s for s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
                                if s in signal.Signals.__members__)
            raise SpecError(f"preemption.signals[{i}]: {name!r} is not a signal a run can handle (allowed: "
                            f"{allowed}, ...; not {', '.join(UNHANDLED)})")
        found.append(signal.Signals[key])
    if not found:
        raise SpecError("preemption.signals: empty; name at least one signal (SIGTERM, SIGUSR1, ...) or leave the "
                        "preemption table out")
    return found


def check_preemption(preemption: PreemptionSpec) -> None:
    """The rules of the table across its fields (raised as `SpecError`)."""
    signal_numbers(preemption.signals)


def check_requeue(preemption: PreemptionSpec, environ: Mapping[str, str]) -> None:
    """``requeue: always`` where no scheduler can requeue the job: `SpecError` (checked where the ranks run, not
    where a job is submitted from)."""
    if preemption.requeue == "always" and not environ.get("SLURM_JOB_ID"):
        raise SpecError("preemption.requeue: 'always' needs a scheduler that requeues (Slurm: no SLURM_JOB_ID "
                        f"here); use 'auto' (requeues under Slurm, elsewhere ends with exit code {PREEMPTED_EXIT} "
                        "for your scheduler to restart) or 'never'")

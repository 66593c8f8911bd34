"""How `polytrain launch` passes a stop on to the ranks: how long it lets them take, and which signal they get.

A signal to `polytrain launch` (Kubernetes' SIGTERM to the pod, Ctrl-C) goes to the launcher it started, which
passes it on to the ranks; after ``grace`` seconds whatever still runs is killed. A ``polytrain train`` spec with
a ``preemption`` table stops at a step every rank agrees on and writes a checkpoint there, within the table's
``grace_s``: the launch gives it that long (and `MARGIN_S` for the launcher's own exit) instead of the usual
`GRACE_SECONDS`, so that it never cuts the save short.

Open MPI's ``mpirun`` answers SIGTERM by ending its ranks at once (they got the signal, then SIGKILL within the
second: measured with Open MPI 5.0.11), so the stop would never reach its step; SIGUSR1 and SIGUSR2 it passes on
untouched. Under Open MPI's mpirun a SIGTERM to the launch therefore reaches the ranks as the first of those the
spec's table handles (its default signals include SIGUSR1); a run whose table handles neither gets SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from polytrain.launchers.processes import GRACE_SECONDS

MARGIN_S = 15.0  # beyond the ranks' grace_s: the launcher notices their exit and ends itself
PASSED_ON_UNTOUCHED = (signal.SIGUSR1, signal.SIGUSR2)  # what Open MPI's mpirun forwards without ending the job


@dataclass(frozen=True)
class StopPolicy:
    grace: float = GRACE_SECONDS
    forward_as: Mapping[int, int] = field(default_factory=dict)  # a signal received -> the one passed on


def train_spec_tables(program: Sequence[str]) -> dict | None:
    """The tables (with --set values) of the spec a ``polytrain train`` program runs, or None: a script, or a spec
    that cannot be read here (it lives on the cluster)."""
    from polytrain.spec.files import readable_with_overrides, set_values

    if tuple(program[1:4]) != ("-m", "polytrain.cli", "train") or len(program) < 5:
        return None
    return readable_with_overrides(program[4], set_values(tuple(program[5:])))


def preemption_table(program: Sequence[str]) -> dict | None:
    """The ``preemption`` table of the spec ``polytrain train`` runs here, or None: a script, a spec without the
    table, or one that cannot be read here."""
    table = (train_spec_tables(program) or {}).get("preemption", False)
    return {} if table is None else table if isinstance(table, dict) else None  # `preemption:` alone: defaults


def stop_policy(program: Sequence[str], term_ends_ranks: bool) -> StopPolicy:
    """The grace and signal translation for a launch of ``program``; ``term_ends_ranks``: the launcher ends its
    ranks on SIGTERM instead of letting them stop (Open MPI's mpirun)."""
    from polytrain.errors import UserError
    from polytrain.spec.preemption import PreemptionSpec, signal_numbers

    table = preemption_table(program)
    if table is None:
        return StopPolicy()
    defaults = PreemptionSpec()
    try:
        grace = float(table.get("grace_s", defaults.grace_s))
        handled = signal_numbers(tuple(table.get("signals", defaults.signals)))
    except (TypeError, ValueError, UserError):  # a bad table: the ranks refuse it in one line, at once
        return StopPolicy()
    passed = next((s for s in PASSED_ON_UNTOUCHED if s in handled), None) if term_ends_ranks else None
    forward_as = {signal.SIGTERM: passed} if passed is not None else {}
    if term_ends_ranks and passed is None and signal.SIGTERM in handled:
        print("polytrain launch: note: preemption.signals handles neither SIGUSR1 nor SIGUSR2, and Open MPI's "
              "mpirun ends its ranks on a SIGTERM: a SIGTERM to this launch will stop nothing at a step (add "
              "SIGUSR1 to preemption.signals)", file=sys.stderr, flush=True)
    return StopPolicy(max(GRACE_SECONDS, grace + MARGIN_S), forward_as)

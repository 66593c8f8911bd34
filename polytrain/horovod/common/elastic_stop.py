"""Preemption in ``hvd.elastic.run`` (the shim, both frameworks): a signal stops every rank at one commit.

A Horovod script has no spec, so the ``preemption`` table comes from the environment, and is off unless asked for:
``POLYTRAIN_PREEMPTION_SIGNALS`` (e.g. ``SIGTERM,SIGUSR1``) turns it on, ``POLYTRAIN_PREEMPTION_GRACE_S``
(default 120) and ``POLYTRAIN_PREEMPTION_REQUEUE`` (auto, never, always; default auto) are the table's other
fields. A rank that gets one of the signals only notes it (`polytrain.train.preemption.StepStop`). The ranks agree
at the next ``state.commit()``: the commit's closing sync point (a barrier in Horovod's own) becomes an all-reduce
of the notes, so no collective is added. Once one rank was signalled, every rank stops right after that commit —
which rank 0 has written to the state directory — with exit code 75 (resumable); rank 0 leaves a mark there, and
the job's next start (a requeue, a relaunch) resumes from that commit as a restarted job does.

Under polytrain's elastic driver (the shim re-forms its group in place) a signal to some ranks only is a host
going away, not the job's end: after the commit the signalled ranks leave with exit code 75 (`LeftAtCommit`) and
the others go on in place at the smaller size from that commit, as after hosts removed. A signal to every rank
still stops the whole job as above.

The state directory must be one the next start can read (``POLYTRAIN_HOROVOD_ELASTIC_DIR`` on shared storage
where the job may come back on another node).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from polytrain.errors import UserError
from polytrain.horovod.common import elastic_files
from polytrain.spec.preemption import PreemptionSpec, signal_numbers
from polytrain.train.preemption import NO_STOP, StepStop

SIGNALS, GRACE, REQUEUE = "POLYTRAIN_PREEMPTION_SIGNALS", "POLYTRAIN_PREEMPTION_GRACE_S", "POLYTRAIN_PREEMPTION_REQUEUE"
MARK = "preempted"  # in the state directory: the last commit is where a preempted job stopped
RESUME = "the job's next start resumes from that commit (hvd.elastic's state directory)"


class StoppedAtCommit(BaseException):
    """Every rank stops at this commit (a BaseException: a script's ``except Exception`` must not swallow it)."""


class LeftAtCommit(BaseException):
    """Under polytrain's elastic driver, this signalled rank leaves the job at this commit while the ranks not
    signalled go on in place (their state is that commit: nothing to redo). The leaver exits with code 75, which
    the driver counts as its host's failure: the host is left out of the next round."""


def preemption_table(env: Mapping[str, str] = os.environ) -> PreemptionSpec | None:
    """The table the environment asks for, or None; a bad value is a `UserError` naming the variable."""
    names = tuple(name.strip() for name in env.get(SIGNALS, "").split(",") if name.strip())
    if not names:
        return None
    try:
        signal_numbers(names)
    except UserError as exc:
        raise UserError(f"{SIGNALS}={env[SIGNALS]!r}: {exc}") from None
    try:
        grace = float(env.get(GRACE, "120"))
    except ValueError:
        grace = math.nan
    if not grace > 0 or math.isinf(grace):
        raise UserError(f"{GRACE}={env.get(GRACE)!r}: seconds from the signal to the exit, a number > 0")
    requeue = env.get(REQUEUE, "auto")
    if requeue not in ("auto", "never", "always"):
        raise UserError(f"{REQUEUE}={requeue!r}: one of auto, never, always")
    return PreemptionSpec(signals=names, requeue=requeue, grace_s=grace)


def start(rank: int, env: Mapping[str, str] = os.environ) -> StepStop:
    """The run's stop, its signals handled from now on (`NO_STOP` where the environment asks for none)."""
    table = preemption_table(env)
    return StepStop(table, rank).install("hvd.elastic's state directory", env) if table is not None else NO_STOP


def mark(directory: Path) -> None:
    """Rank 0, after the stop: the last commit in ``directory`` is where this job resumes."""
    (directory / MARK).write_text("the job was preempted after its last commit here\n")


def take_mark(directory: Path) -> bool:
    """Whether a preempted run left its mark in ``directory`` (removed: it holds for one start only). Only a
    directory private to this user counts: a fresh start never trusts, nor fails on, one another user made."""
    try:
        if elastic_files.private_dir(directory, create=False) is None:
            return False
        (directory / MARK).unlink()
    except (elastic_files.ElasticStateError, OSError):
        return False
    return True

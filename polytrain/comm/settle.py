"""One rank's work made every rank's outcome (`settled`): what one rank does alone (rank 0 writing a checkpoint,
checking a directory) fails on every rank at once, and a rank still at its work is waited for, not timed out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from polytrain.errors import TrainingFailure, UserError
from polytrain.observe.watchdog import watchdog_of

if TYPE_CHECKING:
    from polytrain.protocols import Backend

T = TypeVar("T")


def settled(backend: Backend, size: int, action: Callable[[], T]) -> T:
    """Run ``action`` on this rank, then let every rank learn whether any rank's action failed.

    For what one rank does alone (rank 0 writing a checkpoint, checking the output directory; one rank
    reading a file that another cannot): without this, the ranks that did not fail would wait in their next
    collective until its timeout. Returns this rank's result (only the outcome travels); when any rank
    failed, every rank raises the first failure's error, with its class and its one line, so all exit
    with the same reason and code. A failure that is not a `UserError`/`TrainingFailure`/`OSError` (a bug)
    still tells the others, and then propagates unchanged on its own rank.

    Waiting for a rank still at its action is not a stall: while the job's watchdog runs
    (`polytrain.observe.watchdog.start_watchdog`, on this backend), a rank that is done waits on the side channel
    (`StallWatchdog.await_peers`) for as long as the others are alive, and only then meets them in the
    collective that carries the outcomes — so a checkpoint written to a slow disk never meets the collective
    timeout, while a rank that died is named once its heartbeat has been still that long.
    """
    room = watchdog_of(backend) if size > 1 else None
    mine: tuple[str, str] | None = None
    result = None
    with room.own_part() if room is not None else contextlib.nullcontext():
        try:
            result = action()
        except (UserError, TrainingFailure) as exc:
            mine, raised = (type(exc).__name__, str(exc)), exc
        except OSError as exc:
            mine, raised = ("TrainingFailure", f"{type(exc).__name__}: {exc}"), exc
        except Exception as exc:
            mine, raised = ("TrainingFailure", f"an internal error ({type(exc).__name__}: {exc})"), exc
    lost: TrainingFailure | None = None
    if room is not None:
        try:
            room.await_peers()
        except TrainingFailure as exc:
            lost = exc
    if lost is not None:  # this rank's own failure, if any, says more than the peer it then lost
        raise raised if mine is not None else lost
    everyone = backend.all_gather_object(mine) if size > 1 else [mine]
    failed = [(rank, failure) for rank, failure in enumerate(everyone) if failure is not None]
    if mine is not None:
        raise raised
    if failed:
        rank, (kind, message) = failed[0]
        cls = _error_classes().get(kind, TrainingFailure)
        raise cls(" ".join(message.split()) if rank == 0 else f"rank {rank}: {' '.join(message.split())}")
    return result  # type: ignore[return-value]  # set whenever no rank failed


def _error_classes() -> dict[str, type[Exception]]:
    """polytrain's error classes by name (those defined anywhere that is imported, e.g. CheckpointError)."""
    found: dict[str, type[Exception]] = {}
    todo: list[type[Exception]] = [UserError, TrainingFailure]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found

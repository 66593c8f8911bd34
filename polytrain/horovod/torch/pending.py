"""Submitted ops behind int handles: queued at submission, launched in order, finished by ``synchronize``.

The rule that keeps ranks in step when an op fails:

1. What a rank can check alone (the op, dtype, contiguity, a root outside the set, splits,
   Adasum, a name that is already in flight on this rank ...) is checked when the op is
   *submitted*, before it is queued: the call raises there, nothing was exchanged, no rank moved.
2. What needs the other ranks (shapes, dtypes, ops and roots agree; a rank inside ``join``) is
   checked when the op is *launched*, from the metadata records every rank all-gathers before
   any data moves (`collectives.announce`). Every rank sees the same records, so every rank
   reaches the same verdict: a refused op moves no data anywhere, ``synchronize`` of its handle
   raises on every rank, and the ops after it go on as usual.

Ops launch lazily: ``synchronize`` or ``poll`` of a handle first launches, in submission order,
every op this rank submitted before it. So a rank may submit an async op that its peers submit
only later (after a ``barrier``, which launches nothing), as Horovod's matching by name allows;
the ranks must still launch their ops in the same order. DistributedOptimizer's gradient
buckets do not go through this queue: they start during backward (see `optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polytrain.horovod.torch import stall
from polytrain.horovod.torch.runtime import runtime
from polytrain.observe.timeline import COLLECTIVES


@dataclass
class Pending:
    """One submitted op: how to start it, what to wait for and how to produce its output."""

    label: str
    name: str | None = None
    process_set_id: int = 0
    seq: int = 0
    group: Any = None
    works: list[Any] = field(default_factory=list)
    finish: Callable[[], Any] = lambda: None
    #: starts the op (metadata exchange, then the data's collective); None once started
    launch: Callable[[Pending], None] | None = None
    #: why the op was refused at launch (raised by ``synchronize`` of its handle)
    error: BaseException | None = None
    kind: str = ""
    nbytes: int = 0
    started: float = 0.0  # timeline clock, when the op was launched (metadata exchange included)

    def done(self) -> bool:
        return self.launch is None and all(w is None or w.is_completed() for w in self.works)

    def in_flight(self) -> bool:
        return self.error is None and not self.done()

    def result(self) -> Any:
        for work in self.works:
            stall.wait(work, self.label, self.process_set_id, self.seq, self.group)
        timeline = runtime().timeline
        if timeline.enabled:
            timeline.complete(self.label, "collective", self.started, timeline.now(), track=COLLECTIVES,
                              op=self.kind, bytes=self.nbytes, process_set=self.process_set_id)
        return self.finish()


def start(pending: Pending) -> None:
    """Launch ``pending`` now (it must be this rank's next op); a refusal is kept for ``synchronize``."""
    launch, pending.launch = pending.launch, None
    if launch is None:
        return
    try:
        launch(pending)
    except Exception as exc:
        if runtime().broken:  # a stall shutdown or a lost peer: nothing after it can run
            raise
        pending.error = exc
        pending.works = []


def combine(label: str, name: str | None, parts: list[Pending]) -> Pending:
    """One op made of ``parts`` (a grouped allgather/reducescatter): launched, waited for and refused together."""

    def launch(pending: Pending) -> None:
        for part in parts:
            part_launch, part.launch = part.launch, None
            if part_launch is not None:
                part_launch(part)
            pending.works.extend(part.works)
        if parts:
            first = parts[0]
            pending.process_set_id, pending.seq, pending.group = first.process_set_id, first.seq, first.group
            pending.kind, pending.started, pending.nbytes = first.kind, first.started, sum(p.nbytes for p in parts)

    return Pending(label=label, name=name, launch=launch, finish=lambda: [part.finish() for part in parts])


def submit(pending: Pending, what: str = "process") -> int:
    """Queue ``pending``; its handle. A name still in flight on this rank is refused, as Horovod does."""
    state = runtime()
    if pending.name is not None:
        other = state.active.get(pending.name)
        if other is not None and other.in_flight():
            raise ValueError(f"Requested to {what} a tensor with the same name as another tensor that is currently "
                             f"being processed ({pending.name!r}). If you want to request another tensor, use a "
                             "different tensor name.")
        state.active[pending.name] = pending
    handle = state.next_handle
    state.next_handle += 1
    state.handles[handle] = pending
    state.queue.append(pending)
    return handle


def flush(upto: Pending | None = None) -> None:
    """Launch queued ops in submission order, up to and including ``upto`` (all when None)."""
    if upto is not None and upto.launch is None:
        return
    queue = runtime().queue
    while queue:
        pending = queue.pop(0)
        start(pending)
        if pending is upto:
            return


def poll(handle: int) -> bool:
    """True when the op behind ``handle`` has completed (``synchronize`` will not block).

    An op still queued is launched (with the ops queued before it) and reported not complete.
    """
    pending = runtime().handles.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle} is not a pending Horovod operation")
    if pending.launch is not None:
        flush(pending)
        return pending.error is not None
    return pending.error is not None or pending.done()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its output (None for an unknown handle).

    Raises the op's error when the ranks refused it at launch (on every rank alike).
    """
    state = runtime()
    pending = state.handles.pop(handle, None)
    if pending is None:
        return None
    if pending.name is not None and state.active.get(pending.name) is pending:
        del state.active[pending.name]
    flush(pending)
    if pending.error is not None:
        raise pending.error
    return pending.result()


__all__ = ["poll", "synchronize"]

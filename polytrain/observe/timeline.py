"""A per-rank record of what training spent its time on, merged into one Chrome-trace JSON.

Each rank keeps complete events (name, category, start, duration, arguments) in memory;
at the end rank 0 writes every rank's events into one file in the Chrome trace event
format (open it in https://ui.perfetto.dev or ``chrome://tracing``): one process track
per rank (``pid`` = rank), with threads for the training loop and the collectives.

Times are microseconds since each rank's *origin*; the Trainer sets the origin right after
a barrier, so the ranks' tracks line up to within one barrier's skew even across hosts
whose clocks differ.

When no timeline is asked for, code talks to `NULL`, whose methods do nothing and
allocate nothing: ``with timeline.span(...)`` then costs one attribute lookup and a call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from polytrain.errors import TrainingFailure, UserError
from polytrain.observe import jsonfiles as jsonfiles

#: Track (Chrome trace "thread") ids within a rank's process.
LOOP, COLLECTIVES, PIPELINE, PIPELINE_IDLE = 0, 1, 2, 3
TRACK_NAMES = {LOOP: "training loop", COLLECTIVES: "collectives", PIPELINE: "pipeline stages",
               PIPELINE_IDLE: "pipeline bubbles"}


class Timeline:
    """The events of one rank."""

    enabled = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def reset_origin(self) -> None:
        """Make "now" time zero (call right after a barrier, so every rank's zero is the same moment)."""
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def origin_wall_us(self) -> float:
        """The origin on the wall clock, in microseconds since the epoch (for merging into another trace)."""
        return (time.time() - (time.perf_counter() - self.origin)) * 1e6

    def complete(self, name: str, category: str, start: float, end: float, track: int = LOOP,
                 **args: Any) -> None:
        """Record an event that ran from ``start`` to ``end`` (`now()` values)."""
        event = {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": track,
                 "ts": round((start - self.origin) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3)}
        if args:
            event["args"] = args
        self.events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, category: str, track: int = LOOP, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, category, start, time.perf_counter(), track, **args)


class _NullTimeline:
    """The timeline when none was asked for: every method is a no-op."""

    enabled = False
    rank = 0
    events: list[dict[str, Any]] = []
    _nothing = contextlib.nullcontext()

    def reset_origin(self) -> None:
        pass

    def now(self) -> float:
        return 0.0

    def complete(self, name: str, category: str, start: float, end: float, track: int = LOOP,
                 **args: Any) -> None:
        pass

    def span(self, name: str, category: str, track: int = LOOP, **args: Any) -> contextlib.nullcontext[None]:
        return self._nothing


NULL = _NullTimeline()


def chrome_trace(events_by_rank: Mapping[int, Iterable[dict[str, Any]]], *,
                 metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One Chrome-trace document: a named process per rank, named tracks, every rank's events."""
    trace: list[dict[str, Any]] = []
    for rank in sorted(events_by_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for track, label in TRACK_NAMES.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": track, "args": {"name": label}})
        trace.extend(events_by_rank[rank])
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_chrome_trace(path: str | os.PathLike[str], events_by_rank: Mapping[int, Iterable[dict[str, Any]]],
                       *, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the merged trace atomically (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(jsonfiles.dumps(chrome_trace(events_by_rank, metadata=metadata)))
    os.replace(partial, target)
    return target


def write_timeline_file(path: str, events_by_rank: dict[int, Any], meta: dict[str, Any]) -> Path:
    """Write the merged trace, or fail in one line naming --timeline: a path that cannot be written is exit code 2,
    a disk that cannot take it (full, over quota, failing) a failed write, exit code 1."""
    try:
        return write_chrome_trace(path, events_by_rank, metadata=meta)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise TrainingFailure(f"--timeline {path}: cannot write it ({exc.strerror}); free space or give a path "
                                  "on another disk") from None
        raise UserError(f"--timeline {path}: cannot write it ({exc.strerror or exc}); give a path in a writable "
                        f"directory") from None


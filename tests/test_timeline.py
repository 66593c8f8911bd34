"""The timeline's Chrome-trace document and its no-op twin."""

from __future__ import annotations

import json
import time
from pathlib import Path

from polytrain.timeline import COLLECTIVES, LOOP, NULL, Timeline, chrome_trace, write_chrome_trace


def test_spans_are_complete_events_in_microseconds_since_the_origin() -> None:
    timeline = Timeline(rank=3)
    timeline.reset_origin()
    with timeline.span("forward", "compute", step=1):
        time.sleep(0.01)
    start = timeline.now()
    timeline.complete("gradient bucket 0", "collective", start, start + 0.002, track=COLLECTIVES, bytes=64)
    forward, bucket = timeline.events
    assert forward["ph"] == "X" and forward["pid"] == 3 and forward["tid"] == LOOP
    assert forward["args"] == {"step": 1}
    assert 0 <= forward["ts"] < 5000 and 10_000 <= forward["dur"] < 200_000
    assert bucket["tid"] == COLLECTIVES and bucket["dur"] == 2000.0 and bucket["args"]["bytes"] == 64
    assert bucket["ts"] >= forward["ts"] + forward["dur"]


def test_null_timeline_records_nothing() -> None:
    with NULL.span("forward", "compute"):
        pass
    NULL.complete("x", "collective", 0.0, 1.0)
    assert NULL.events == [] and not NULL.enabled


def test_merged_trace_names_one_process_per_rank(tmp_path: Path) -> None:
    ranks = {r: Timeline(rank=r) for r in (0, 1)}
    for timeline in ranks.values():
        with timeline.span("optimizer step", "optimizer"):
            pass
    path = write_chrome_trace(tmp_path / "sub" / "trace.json", {r: t.events for r, t in ranks.items()},
                              metadata={"backend": "ddp"})
    document = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert sorted(e["pid"] for e in document["traceEvents"] if e["ph"] == "X") == [0, 1]
    assert document["otherData"] == {"backend": "ddp"}
    assert not list(path.parent.glob(".*partial"))
    assert chrome_trace({})["traceEvents"] == []

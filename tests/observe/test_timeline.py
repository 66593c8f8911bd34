"""The timeline's Chrome-trace document and its no-op twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polytrain.observe import timeline as timeline_mod
from polytrain.observe.timeline import COLLECTIVES, LOOP, NULL, Timeline, chrome_trace, write_chrome_trace


def test_spans_are_complete_events_in_microseconds_since_the_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([99.0, 100.0, 100.003, 100.0155, 100.02])  # made, origin, span start, span end, now: no sleep
    monkeypatch.setattr(timeline_mod.time, "perf_counter", lambda: next(clock))
    timeline = Timeline(rank=3)
    timeline.reset_origin()
    with timeline.span("forward", "compute", step=1):
        pass
    start = timeline.now()
    timeline.complete("gradient bucket 0", "collective", start, start + 0.002, track=COLLECTIVES, bytes=64)
    forward, bucket = timeline.events
    assert forward["ph"] == "X" and forward["pid"] == 3 and forward["tid"] == LOOP
    assert forward["args"] == {"step": 1}
    assert forward["ts"] == pytest.approx(3000.0) and forward["dur"] == pytest.approx(12_500.0)
    assert bucket["tid"] == COLLECTIVES and bucket["dur"] == pytest.approx(2000.0) and bucket["args"]["bytes"] == 64
    assert bucket["ts"] == pytest.approx(20_000.0)


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

"""``torch.profiler`` over the profiled steps, written as a Chrome trace, ``<output>/profile/rank<r>.pt.trace.json``,
which Perfetto, chrome://tracing and TensorBoard's PyTorch profiler plugin open. Each step is a
``ProfilerStep#<step>`` range (the plugin's step marker) holding the forward and backward operators, the backend's
collectives (``c10d::allreduce_``, ``gloo:all_reduce``, NCCL kernels on a GPU) and ``Optimizer.step``. With a
timeline (``--timeline``), the rank's own timeline spans of the profiled steps (data, micro-step, optimizer step,
gradient buckets) are merged into the trace as a process of their own, on the profiler's clock."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from polytrain.errors import TrainingFailure
from polytrain.observe.timeline import TRACK_NAMES


class TorchProfiler:
    def __init__(self, spec: Any, directory: Path, rank: int, timeline: Any = None) -> None:
        self.first, self.last = spec.steps
        self.timeline = timeline if timeline is not None and timeline.enabled else None
        self.path = directory / f"rank{rank}.pt.trace.json"
        activities = [ProfilerActivity.CPU] if "cpu" in spec.activities else []
        if "cuda" in spec.activities and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.activities, self.memory = activities, spec.memory
        self._profiler: profile | None = None

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        if not self.first <= number <= self.last or not self.activities:
            yield
            return
        if self._profiler is None:
            self._profiler = profile(activities=self.activities, profile_memory=self.memory, record_shapes=self.memory)
            self._profiler.start()
        with record_function(f"ProfilerStep#{number}"):
            yield
        if number == self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also what a run that failed mid-profile recorded)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(self.path))
            whole = _ends_whole(self.path)
            if whole and self.timeline is not None:
                merge_timeline(self.path, self.timeline)
        except OSError as exc:
            raise TrainingFailure(f"profile: cannot write {self.path} ({exc.strerror or exc}); free space or choose "
                                  "another output directory") from exc
        if not whole:  # torch.profiler says nothing when the disk is full: the trace is cut short or missing
            raise TrainingFailure(f"profile: {self.path} was not written whole (is the disk full?); free space or "
                                  "choose another output directory")


def _ends_whole(path: Path) -> bool:
    """Whether the trace file is there and ends as a JSON object does (its last bytes: traces are large)."""
    try:
        with path.open("rb") as file:
            file.seek(max(path.stat().st_size - 64, 0))
            return file.read().rstrip().endswith(b"}")
    except FileNotFoundError:
        return False


def merge_timeline(path: Path, timeline: Any) -> None:
    """Add ``timeline``'s events that fall in the trace's time span to the trace at ``path``: one process,
    ``polytrain timeline (rank r)``, with its tracks; timestamps moved onto the trace's clock (its ``ts`` is
    microseconds after ``baseTimeNanoseconds``, on the wall clock)."""
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        return
    shift = timeline.origin_wall_us() - trace.get("baseTimeNanoseconds", 0) / 1000
    begin, end = min(e["ts"] for e in spans), max(e["ts"] + e.get("dur", 0) for e in spans)
    pid = f"polytrain timeline (rank {timeline.rank})"
    merged = [{**event, "pid": pid, "ts": event["ts"] + shift} for event in timeline.events
              if begin <= event["ts"] + shift <= end]
    names = {event["tid"] for event in merged}
    merged += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": pid}}]
    merged += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": TRACK_NAMES.get(tid, str(tid))}}
               for tid in sorted(names)]
    trace["traceEvents"] += merged
    path.write_text(json.dumps(trace))

"""TensorFlow's profiler (``tf.profiler.experimental``) over the profiled steps, written where TensorBoard's profile
plugin reads it: ``<output>/profile/rank<r>/plugins/profile/<time>/<host>.xplane.pb``. Each step is a
``train`` trace event with its ``step_num`` (the plugin's step marker). ``activities`` and ``memory`` are
torch.profiler's options: TensorFlow's profiler records host and device activity and memory by itself; the
timeline is not merged into its XSpace (``--timeline`` writes its own trace)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tensorflow as tf


class TensorFlowProfiler:
    def __init__(self, spec: Any, directory: Path, rank: int, timeline: Any = None) -> None:
        self.first, self.last = spec.steps
        self.logdir = directory / f"rank{rank}"
        self._running = False

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        if not self.first <= number <= self.last:
            yield
            return
        if not self._running:
            self.logdir.mkdir(parents=True, exist_ok=True)
            tf.profiler.experimental.start(str(self.logdir))
            self._running = True
        with tf.profiler.experimental.Trace("train", step_num=number, _r=1):
            yield
        if number == self.last:
            self.close()

    def close(self) -> None:
        if self._running:
            self._running = False
            tf.profiler.experimental.stop()

"""The framework's own profiler over the spec's ``profile.steps`` on ``profile.ranks``: one module per framework
(a registry row, `polytrain.registry.PROFILERS`), each a class made with ``(profile, directory, rank, timeline)``
whose ``step(number)`` is a context manager around optimizer step ``number``: it starts the profiler at the first
profiled step (or the first one a resumed run reaches), marks each step, and writes the trace after the last.
``close()`` stops a profiler a failure left running, keeping what it recorded. Without a profile table, or on a
rank not profiled, the Trainer holds `NO_PROFILER`, whose step costs one call.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

from polytrain import registry


class Profiler(Protocol):
    def step(self, number: int) -> contextlib.AbstractContextManager[None]: ...

    def close(self) -> None: ...


class NoProfiler:
    _NOTHING = contextlib.nullcontext()  # reusable: entering it does nothing, and makes no generator per step

    def step(self, number: int) -> contextlib.AbstractContextManager[None]:
        return self._NOTHING

    def close(self) -> None:
        pass


NO_PROFILER = NoProfiler()


def profile_dir(output: str | Path) -> Path:
    """Where the traces go: ``<output>/profile`` (``tensorboard --logdir <output>`` shows them)."""
    return Path(output) / "profile"


def open_profiler(spec: Any, rank: int, timeline: Any = None) -> Profiler:
    """The spec's profiler on this rank, or `NO_PROFILER`; ``timeline``: the run's (merged into the trace where
    the framework's trace format allows)."""
    profile = spec.profile
    if profile is None or rank not in profile.ranks:
        return NO_PROFILER
    return registry.PROFILERS[spec.framework].load()(profile, profile_dir(spec.output), rank, timeline)

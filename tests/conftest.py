"""Fixtures shared by all tests."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from procs import loopback_env


@pytest.fixture
def loopback() -> dict[str, str]:
    return loopback_env()


@pytest.fixture(autouse=True)
def _no_mpi_segments_left_behind() -> Iterator[None]:
    """Open MPI leaves a killed rank's /dev/shm segment file (16 MiB) behind: remove what a test's jobs left."""
    from polytrain.launchers import shm_leftovers

    before = shm_leftovers.present()
    yield
    shm_leftovers.remove_orphans(before)


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What the Trainer prints during the test (see `trainer_runs.capture_progress`)."""
    from trainer_runs import capture_progress

    return capture_progress(monkeypatch)

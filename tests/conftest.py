"""Fixtures shared by all tests."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import loopback_env

TESTS = Path(__file__).resolve().parent
#: the files that start local Ray clusters (paths under tests/): one at a time (scripts/test.sh runs three workers)
RAY_FILES = ("multiproc/test_ray.py", "multiproc/test_own_loop_ray.py", "multiproc/test_elastic.py",
             "multiproc/test_sweep.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (scripts/test.sh): a file's tests run on one worker, so its
    module fixtures are made once; the namespace-cluster tests share one worker (its session cluster), and so do
    the files that start local Ray clusters. First of the hooks: xdist's own reads the marks to name the group."""
    for item in items:
        path = item.path.relative_to(TESTS)
        group = ("cluster" if path.parts[0] == "cluster" else "ray" if path.as_posix() in RAY_FILES else str(path))
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker whose tests came out of collection without their group (a pytest that xdist cannot suffix, such
    as 9.2) would let two workers run one file's tests and two Ray or namespace clusters at once: stop there."""
    if getattr(session.config.option, "loadgroup", False) and session.items:
        if "@" not in session.items[0].nodeid:
            raise pytest.UsageError(f"--dist loadgroup did not group the tests under pytest {pytest.__version__}; "
                                    "install the pytest that constraints.txt pins")


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

"""Fixtures shared by all tests."""

from __future__ import annotations

import io
import resource
from collections.abc import Iterator
from pathlib import Path

import durations
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
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        path = item.path.relative_to(TESTS)
        group = ("cluster" if path.parts[0] == "cluster" else "ray" if path.as_posix() in RAY_FILES else str(path))
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    # the heaviest groups first (xdist hands the groups out in this order: see pytest_configure), so that no
    # long file starts near the end and runs on alone while the other workers have finished
    measured = durations.load()
    ordered = sorted(groups.values(), key=lambda group: -_group_seconds(group, measured))
    items[:] = [item for group in ordered for item in group]


def _group_seconds(group: list[pytest.Item], measured: dict[str, int]) -> float:
    """The group's files' seconds in the last measured run (tests/durations.json), else a guess from its tests."""
    seconds = 0.0
    for path in {item.path.relative_to(TESTS).as_posix() for item in group}:
        if path in measured:
            seconds += measured[path]
        else:
            seconds += 1.5 * sum(_weight(item) for item in group if item.path.relative_to(TESTS).as_posix() == path)
    return seconds


def _weight(item: pytest.Item) -> int:
    """A rough cost of a test, for ordering only: one that starts processes costs ~20 unit tests, a slow one twice that."""
    multiproc = item.get_closest_marker("multiproc") is not None or item.path.relative_to(TESTS).parts[0] == "cluster"
    return 1 + 20 * multiproc + 20 * (item.get_closest_marker("slow") is not None)


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    """xdist would hand the groups out largest (by number of tests) first, which puts a heavy file of a few
    multi-process tests behind every table of quick cases: keep the order the collection hook made."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    _CONFIG[:] = [config]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure is named on its own line when it happens (scripts/test.sh runs quietly: a run cut short by CI's
    time limit would otherwise end on dots, with no name for what failed); the summary still lists them all."""
    if report.failed and _CONFIG:
        terminal = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(f"\nFAILED ({report.when}) {report.nodeid}")


def _cpu_seconds() -> float:
    """CPU this worker and the processes it has reaped (their own reaped children included) have used."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_CPU_AT_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Each test's CPU seconds, its processes' included, as a ``cpu_s`` property of the JUnit report: on 2 cores
    the suite is CPU-bound, so this, not a test's wall time, is what it costs the run (tests/durations.py)."""
    yield
    if _CPU_AT_START in item.stash:
        item.user_properties.append(("cpu_s", round(_cpu_seconds() - item.stash[_CPU_AT_START], 1)))


_CPU_AT_START = pytest.StashKey[float]()


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

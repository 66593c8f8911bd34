"""Fixtures for tests on a real cluster of network namespaces (see netns.py): ``cluster`` (2 hosts, once per
session) and ``cluster3`` (3 hosts, made only when a test asks). Tests skip, saying why, where namespaces or
sshd cannot be made. ``cluster_clean`` (autouse) kills what a test left on the hosts and undoes its link faults.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import Cluster, ClusterUnavailable, cluster_unavailable  # noqa: E402

_live: list[Cluster] = []


def _make(n: int, tmp_path_factory: pytest.TempPathFactory, tag_suffix: str) -> Iterator[Cluster]:
    why = cluster_unavailable()
    if why:
        pytest.skip(f"no cluster of network namespaces here: {why}")
    cluster = Cluster(n, tmp_path_factory.mktemp(f"cluster{n}"))
    if tag_suffix:
        cluster = Cluster(n, cluster.workdir, tag=f"{cluster.tag}{tag_suffix}")
    try:
        cluster.start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no cluster of network namespaces here: {exc}")
    _live.append(cluster)
    try:
        yield cluster
    finally:
        _live.remove(cluster)
        cluster.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two hosts, h1 and h2, each with sshd; brought up once per session."""
    yield from _make(2, tmp_path_factory, "")


@pytest.fixture(scope="session")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three hosts (a cluster of its own, beside ``cluster``); made only when a test asks."""
    yield from _make(3, tmp_path_factory, "b")


@pytest.fixture(autouse=True)
def cluster_clean() -> Iterator[None]:
    """After each test: no job process left on any host, links up, no netem."""
    yield
    for cluster in list(_live):
        cluster.kill_jobs()

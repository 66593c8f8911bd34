"""The own loop of test_own_loop.py on Ray Train's workers (``polytrain launch --launcher ray``, fsdp on a local
Ray): it names its launcher to the ranks and equals one process. A file of its own so that only Ray's tests share
a pytest worker (tests/conftest.py: one local Ray at a time), not the rest of the own-loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiproc.test_own_loop import one_process, run_under_launcher  # noqa: F401 - one_process is the fixture used below

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def test_two_ranks_equal_one_process_on_ray_workers(one_process: dict, tmp_path: Path) -> None:  # noqa: F811
    run_under_launcher(one_process, tmp_path, "fsdp-ray")

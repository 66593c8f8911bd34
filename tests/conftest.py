"""Fixtures shared by all tests."""

from __future__ import annotations

import pytest
from procs import loopback_env


@pytest.fixture
def loopback() -> dict[str, str]:
    return loopback_env()

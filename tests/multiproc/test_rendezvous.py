"""Rendezvous problems end (after reliability.startup_timeout_s) in one line that says what to check.

Real processes with torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
as a cluster script would set them: a master nobody listens on, a master port another process
holds, a world size larger than the ranks that came. (A missing launcher binary is covered in
tests/launchers/test_launcher_dispatch.py.) How long they take against the timeout is measured by
bench/fault_timing.py, not asserted here.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from procs import free_port, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

TIMEOUT_S = 4


def start_rank(tmp_path: Path, rank: int, port: int, world_size: int = 2):
    cmd = [sys.executable, "-m", "polytrain.cli", "train", "--quiet", "--set",
           f"reliability.startup_timeout_s={TIMEOUT_S}", "--set", f"output={tmp_path}"]
    env = loopback_env(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    return run(cmd, env=env, timeout=90)


def assert_one_line(result, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("polytrain: error: rendezvous: ") and message in lines[0], lines[0]
    assert result.left_behind == []


def test_unreachable_master(tmp_path: Path) -> None:
    port = free_port()
    result = start_rank(tmp_path, 1, port)
    assert_one_line(result, f"rank 1 cannot reach the master at 127.0.0.1:{port} within {TIMEOUT_S} s "
                            "(reliability.startup_timeout_s); check MASTER_ADDR/MASTER_PORT, that rank 0 is running")


def test_master_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = start_rank(tmp_path, 0, port)
    assert_one_line(result, f"rank 0 cannot listen on MASTER_PORT {port} at 127.0.0.1: the port is in use by "
                            "another process; choose another MASTER_PORT")


def test_fewer_ranks_than_the_world_size(tmp_path: Path) -> None:
    result = start_rank(tmp_path, 0, free_port(), world_size=3)
    assert_one_line(result, f"only 1 of 3 ranks reached the master 127.0.0.1:{{}} within {TIMEOUT_S} s".split(":{")[0])
    assert "check that every rank was started and that they agree on the world size (-np / WORLD_SIZE=3)" in \
        result.stderr

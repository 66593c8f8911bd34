"""Helpers for tests that start real processes: timeouts, loopback pinned, no process left behind.

Import as ``from procs import run, check, loopback_env, free_port`` (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment for a multi-process test: loopback only, one thread per rank, MPI as root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_",
                                                                     "TORCHELASTIC_", "PMIX_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "GROUP_RANK"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
        OMPI_MCA_oob_tcp_if_include="lo", TF_CPP_MIN_LOG_LEVEL="2",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


def _tagged(token: str) -> dict[int, str]:
    """The live processes whose environment carries ``token`` (workers in sessions of their own too), with
    their command lines; a zombie's environment reads empty, so the dead are not counted."""
    needle = f"POLYTRAIN_TEST_TOKEN={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def _kill_tagged(token: str) -> None:
    """SIGKILL every process whose environment carries ``token``."""
    for pid in _tagged(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


class Finished(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """A finished command, with ``left_behind``: the command lines of the processes it started that were
    still running when it exited (``run`` kills them then; a test asserts there were none)."""

    left_behind: list[str] = []


def run(cmd: list[str], *, timeout: float = 240, env: dict[str, str] | None = None,
        cwd: Path | str | None = None) -> Finished:
    """Run ``cmd`` in its own session; on timeout kill it and everything it started, and fail the test.

    Every process started gets a unique ``POLYTRAIN_TEST_TOKEN`` in its environment, so even workers a
    launcher put in sessions of their own are found and killed when the command ends.
    """
    token = uuid.uuid4().hex
    env = dict(env if env is not None else loopback_env(), POLYTRAIN_TEST_TOKEN=token)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd or REPO, start_new_session=True)
    left: dict[int, str] = {}
    try:
        out, err = proc.communicate(timeout=timeout)
        left = _tagged(token)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # let a launcher stop its workers first
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of this group may outlive the test
        except ProcessLookupError:
            pass
        _kill_tagged(token)
    result = Finished(cmd, proc.returncode, out, err)
    result.left_behind = sorted(left.values())
    return result


def check(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (
        f"exit {result.returncode}: {' '.join(result.args)}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-4000:]}")
    return result

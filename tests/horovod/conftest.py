"""Launchers for the polytrain.horovod.tensorflow / .keras tests (tensorflow/, keras/): real processes,
timeouts, loopback. The torch tests use ``hvd_launch`` (tests/hvd_launch.py)."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import BIN, REPO, check, loopback_env, run

PYTHON = sys.executable


def tf_env(impl: str, **extra: str) -> dict[str, str]:
    """The environment of a TensorFlow rank: loopback, one thread, quiet logs, the chosen Horovod."""
    return loopback_env(POLYTRAIN_HOROVOD_IMPL=impl, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
                        TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **extra)


@functools.cache
def horovod_tf_available() -> bool:
    """Real Horovod with TensorFlow ops importable (probed in a subprocess: it loads TensorFlow)."""
    if importlib.util.find_spec("horovod") is None:
        return False
    probe = run([PYTHON, "-c", "import horovod.tensorflow"], timeout=180, env=tf_env("horovod"))
    return probe.returncode == 0


class Launch:
    """Start a script on N ranks and collect each rank's ``RESULT <json>`` line.

    ``here`` is the folder of the test that asked for it (where its worker scripts are).
    """

    python = PYTHON
    env = staticmethod(tf_env)

    def __init__(self, here: Path) -> None:
        self.here = here

    @staticmethod
    def mpirun(nproc: int, script: Path | str, *args: str, impl: str = "shim", timeout: float = 300,
               **extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / "mpirun"), "-np", str(nproc), "--oversubscribe", "--bind-to", "none", PYTHON,
               str(script), *args]
        return check(run(cmd, timeout=timeout, env=tf_env(impl, **extra)))

    @staticmethod
    def horovodrun(nproc: int, script: Path | str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", PYTHON,
               str(script), *args]
        return check(run(cmd, timeout=timeout, env=tf_env("horovod")))

    @staticmethod
    def single(script: Path | str, *args: str, impl: str = "shim", timeout: float = 300,
               **extra: str) -> subprocess.CompletedProcess[str]:
        return run([PYTHON, str(script), *args], timeout=timeout, env=tf_env(impl, **extra))

    def example(self, name: str, impl: str, launcher: str = "mpirun") -> dict:
        """Run ``examples/horovod/<name>`` on 2 ranks; rank 0's result."""
        script = REPO / "examples" / "horovod" / name
        if launcher == "horovodrun":
            proc = self.horovodrun(2, script, timeout=540)
        else:
            proc = self.mpirun(2, script, impl=impl, timeout=540)
        (result,) = self.results(proc, 1)  # rank 0 reports
        assert result["size"] == 2
        return result

    @staticmethod
    def results(proc: subprocess.CompletedProcess[str], size: int) -> list[dict]:
        """Every rank's RESULT json, indexed by the rank it reports."""
        # Each rank's object is one write, its newline another (PYTHONUNBUFFERED): two ranks' lines can run into
        # each other, so every object is decoded where its marker starts, not line by line.
        decode = json.JSONDecoder().raw_decode
        found = [decode(proc.stdout, at.end())[0] for at in re.finditer("RESULT ", proc.stdout)]
        assert len(found) == size, f"expected {size} RESULT lines:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return sorted(found, key=lambda res: res["rank"])


@pytest.fixture
def launch(request: pytest.FixtureRequest) -> Launch:
    for module in ("tensorflow", "mpi4py"):  # found, not imported: TensorFlow stays out of pytest
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    return Launch(Path(request.path).resolve().parent)


@pytest.fixture
def real_horovod() -> None:
    """Skip unless real Horovod with its TensorFlow ops is installed."""
    if not horovod_tf_available():
        pytest.skip("real Horovod with TensorFlow is not installed (scripts/build_horovod.sh)")

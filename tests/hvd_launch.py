"""Start a worker script under torchrun, mpirun or a horovodrun-style environment; read its results.

Import as ``from hvd_launch import ...`` (tests/ is on pytest's pythonpath); the workers are in
tests/horovod/torch/workers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from procs import BIN, REPO, check, free_port, loopback_env, run

WORKERS = Path(__file__).resolve().parent / "horovod" / "torch" / "workers"
MPIRUN = [str(BIN / "mpirun"), "--oversubscribe", "--map-by", "slot"]


def torchrun_cmd(nproc: int, script: Path | str, *args: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *extra,
            str(script), *args]


def mpirun_cmd(nproc: int, script: Path | str, *args: str) -> list[str]:
    return [*MPIRUN, "-np", str(nproc), sys.executable, str(script), *args]


def launch(launcher: str, nproc: int, script: Path | str, *args: str, env: dict[str, str] | None = None,
           timeout: float = 240, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` ranks with ``launcher`` (torchrun, mpirun, horovodrun-env).

    Workers write ``rank<N>.json`` into RESULT_DIR (read back by `results`): long lines
    printed by several ranks at once can interleave in one pipe.
    """
    result_dir = tempfile.mkdtemp(prefix="hvd-results-")
    environment = loopback_env(RESULT_DIR=result_dir, **{"POLYTRAIN_HOROVOD_IMPL": "shim", **(env or {})})
    if launcher == "torchrun":
        result = run(torchrun_cmd(nproc, script, *args), env=environment, timeout=timeout)
    elif launcher == "mpirun":
        environment.pop("MASTER_ADDR", None)
        result = run(mpirun_cmd(nproc, script, *args), env=environment, timeout=timeout)
    elif launcher == "horovodrun-env":  # horovodrun --gloo's variables and rendezvous server
        result = _launch_env(nproc, script, args, environment, timeout)
    else:
        raise ValueError(launcher)
    result.result_dir = result_dir  # type: ignore[attr-defined]
    return check(result) if expect_ok else result


def _launch_env(nproc: int, script: Path | str, args: tuple[str, ...], environment: dict[str, str],
                timeout: float) -> subprocess.CompletedProcess[str]:
    environment.pop("MASTER_ADDR", None)
    return run([sys.executable, str(WORKERS / "horovodrun_gloo_env.py"), str(nproc), str(script), *args],
               env=environment, timeout=timeout)


def results(completed: subprocess.CompletedProcess[str]) -> dict[int, dict]:
    """Every rank's results (``rank<N>.json`` in the launch's RESULT_DIR), by rank."""
    out: dict[int, dict] = {}
    directory = Path(completed.result_dir)  # type: ignore[attr-defined]
    for path in sorted(directory.glob("rank*.json")):
        data = json.loads(path.read_text())
        out[data["rank"]] = data
    shutil.rmtree(directory, ignore_errors=True)
    return out


def failed_checks(per_rank: dict[int, dict]) -> dict[int, dict]:
    return {rank: bad for rank, data in per_rank.items()
            if (bad := {name: v for name, v in data["checks"].items() if v is not True})}


__all__ = ["REPO", "WORKERS", "failed_checks", "launch", "results"]

"""Elastic restarts: a rank SIGKILLed mid-epoch; the restarted job resumes from the newest checkpoint
and ends with exactly the weights of an uninterrupted run — under torchrun, polytrain's local launcher and Ray
Train (a local Ray started by the launch)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, free_port, loopback_env, read_metrics, run

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

HERE = Path(__file__).parent
SETS = ["model.name=faulty_model:make", "schedule.decay=none", "loop.epochs=2", "checkpoint.every_n_steps=10",
        "optimizer.momentum=0.9", "data.batch_size=32"]


def sets(out: Path) -> list[str]:
    return ["--quiet", *[a for s in [*SETS, f"output={out}"] for a in ("--set", s)]]


def spec_file(tmp_path: Path) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text("framework: torch\n")
    return str(path)


def env(fault_at: int) -> dict[str, str]:
    return loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT=str(fault_at))


@pytest.mark.parametrize("launcher", ["torchrun", "local", "ray"])
def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path: Path, launcher: str) -> None:
    if launcher == "ray":
        pytest.importorskip("ray.train")
    clean = tmp_path / "clean"
    spec = spec_file(tmp_path)
    check(run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", spec,
               *sets(clean)], env=env(-1)))
    killed = tmp_path / "killed"
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "polytrain.cli", "train", spec, *sets(killed)]
    else:  # ray: Ray Train's FailureConfig(max_failures=1) restarts the worker group
        cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", launcher, "-np", "2",
               "--max-restarts", "1", spec, *sets(killed)]
    check(run(cmd, env=env(fault_at=27)))  # mid-epoch 2 (23 steps per epoch); newest checkpoint: 20
    resumes = read_metrics(killed, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] == 20, resumes
    clean_state, clean_manifest = read_model(clean)
    state, manifest = read_model(killed)
    assert manifest["global_step"] == clean_manifest["global_step"] == 46
    for name, arr in clean_state.items():
        np.testing.assert_array_equal(state[name], arr)


def test_under_mpirun_a_dead_rank_ends_the_job_and_resume_auto_continues(tmp_path: Path) -> None:
    """mpirun cannot restart a rank: the job ends non-zero naming the lost rank; the same command with
    --resume auto continues from the newest checkpoint and ends with the uninterrupted run's weights."""
    clean = tmp_path / "clean"
    spec = spec_file(tmp_path)
    check(run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", spec,
               *sets(clean)], env=env(-1)))
    killed = tmp_path / "killed"
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "FAULT_RANK", "-x", "FAULT_AT", "-x", "PYTHONPATH",
           sys.executable, "-m", "polytrain.cli", "train", spec, *sets(killed)]
    mpi_env = env(fault_at=27)
    mpi_env.pop("MASTER_ADDR")
    first = run(cmd, env=mpi_env)
    assert first.returncode != 0
    assert "process rank 1 with PID" in first.stdout + first.stderr and "signal 9" in first.stdout + first.stderr
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-00000020"
    check(run([*cmd, "--resume", "auto"], env=mpi_env))
    assert [e["step"] for e in read_metrics(killed, "resume")] == [20]
    clean_state, _ = read_model(clean)
    state, manifest = read_model(killed)
    assert manifest["global_step"] == 46 and manifest["backend"] == "ddp"
    for name, arr in clean_state.items():
        np.testing.assert_array_equal(state[name], arr)

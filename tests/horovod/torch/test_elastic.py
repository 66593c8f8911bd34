"""hvd.elastic: commit/restore in process, and resuming a job that torchrun restarted."""

import json
import stat
from pathlib import Path

import pytest
from hvd_launch import WORKERS, launch, results, torchrun_cmd
from procs import check, loopback_env, run

pytestmark = pytest.mark.multiproc


def starts(result_dir):
    with open(result_dir / "starts.jsonl") as f:
        return sorted((d["restart"], d["rank"], d["start_epoch"]) for d in map(json.loads, f))


@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_from_the_last_commit(tmp_path):
    env = loopback_env(POLYTRAIN_HOROVOD_IMPL="shim", RESULT_DIR=str(tmp_path),
                       POLYTRAIN_HOROVOD_ELASTIC_DIR=str(tmp_path / "state"))
    check(run(torchrun_cmd(2, WORKERS / "elastic_train.py", "crash", extra=("--max-restarts=1",)), env=env))
    # first attempt from scratch; rank 1 died after committing epoch 3; the restart resumed there
    assert starts(tmp_path) == [(0, 0, 0), (0, 1, 0), (1, 0, 3), (1, 1, 3)]
    # the commits: one safetensors file (no pickle) in a directory private to this user
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["state.safetensors"]
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    for rank in (0, 1):
        final = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert final["restart"] == 1 and final["epochs"] == 6 and final["losses"] == 6
        assert final["max_error"] < 1e-6  # same weights as training without the crash


@pytest.mark.timeout(300)
def test_internal_error_rolls_back_and_reinitialises_in_process(tmp_path):
    completed = launch("mpirun", 2, WORKERS / "elastic_train.py", "raise",
                       env={"POLYTRAIN_HOROVOD_ELASTIC_DIR": str(tmp_path / "state")})
    assert starts(Path(completed.result_dir)) == [(0, 0, 0), (0, 0, 3), (0, 1, 0), (0, 1, 3)]
    per_rank = results(completed)
    assert all(d["max_error"] < 1e-6 and d["epochs"] == 6 and d["losses"] == 6 for d in per_rank.values())

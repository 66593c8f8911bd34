"""hvd.elastic: commit/restore in process, resuming a job that torchrun restarted, and a preempted job."""

import json
import re
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


@pytest.mark.timeout(300)
def test_a_preemption_signal_stops_every_rank_at_one_commit_and_the_next_start_resumes_there(tmp_path):
    """Rank 1 gets SIGTERM before epoch 3's commit: every rank stops right after that commit (the commit's sync is
    the agreement), exit 75; the next start (no restart count: a requeue, a relaunch) resumes from it and ends on
    the weights of training never interrupted."""
    state = tmp_path / "state"
    env = {"POLYTRAIN_HOROVOD_ELASTIC_DIR": str(state), "POLYTRAIN_PREEMPTION_SIGNALS": "SIGTERM,SIGUSR1",
           "POLYTRAIN_PREEMPTION_REQUEUE": "never"}
    stopped = launch("mpirun", 2, WORKERS / "elastic_train.py", "preempt", env=env, expect_ok=False)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    said = re.findall(r"^polytrain: preempted by (.+?): every rank stopped after step (\d+); the job's next start "
                      r"resumes from that commit", stopped.stderr, re.M)
    assert said == [("a signal to another rank", "3")], stopped.stderr[-3000:]  # rank 0's line, after commit 3
    assert starts(Path(stopped.result_dir)) == [(0, 0, 0), (0, 1, 0)]
    assert not list(Path(stopped.result_dir).glob("rank*.json"))  # it stopped: no rank finished
    assert sorted(p.name for p in state.iterdir()) == ["preempted", "state.safetensors"]

    resumed = launch("mpirun", 2, WORKERS / "elastic_train.py", "preempt", env=env)
    assert starts(Path(resumed.result_dir)) == [(0, 0, 3), (0, 1, 3)]
    for final in results(resumed).values():
        assert final["epochs"] == 6 and final["losses"] == 6 and final["max_error"] < 1e-6
    assert [p.name for p in state.iterdir()] == ["state.safetensors"]  # the mark holds for one start

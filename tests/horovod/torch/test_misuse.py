"""Ranks that disagree get an error on every rank, or a stall report and a shutdown: never a hang.

workers/misuse.py makes the ranks disagree on purpose; each test bounds the whole job
with a timeout far below the gloo timeout (30 min) a silent hang would need.
"""

import re
from pathlib import Path

import pytest
from hvd_launch import WORKERS, launch

pytestmark = pytest.mark.multiproc


def outcomes(completed):
    """Each rank's outcome line, read from the files the workers write (not the shared pipe)."""
    found = {}
    for path in sorted(Path(completed.result_dir).glob("outcome*.txt")):
        found[path.stem.removeprefix("outcome")] = path.read_text()
    return found


@pytest.mark.timeout(200)
def test_shape_mismatch_errors_on_every_rank():
    completed = launch("horovodrun-env", 2, WORKERS / "misuse.py", "shape", expect_ok=False, timeout=120)
    assert completed.returncode != 0
    seen = outcomes(completed)
    assert sorted(seen) == ["0", "1"], completed.stdout + completed.stderr[-2000:]
    for text in seen.values():
        assert text.startswith("CollectiveMismatchError: Mismatched collective calls across ranks")
        assert "rank 0 called allreduce('grads': float32[4])" in text
        assert "rank 1 called allreduce('grads': float32[5])" in text


@pytest.mark.timeout(200)
def test_different_ops_error_on_every_rank_of_three():
    completed = launch("horovodrun-env", 3, WORKERS / "misuse.py", "op", expect_ok=False, timeout=120)
    seen = outcomes(completed)
    assert completed.returncode != 0 and sorted(seen) == ["0", "1", "2"], completed.stdout
    for text in seen.values():
        assert "rank 0 called allreduce('loss': float32[2]); ranks 1,2 called allgather('loss': float32[2])" in text


@pytest.mark.timeout(200)
def test_distributed_optimizer_over_different_models_errors_on_every_rank():
    completed = launch("horovodrun-env", 2, WORKERS / "misuse.py", "model", expect_ok=False, timeout=120)
    seen = outcomes(completed)
    assert completed.returncode != 0 and sorted(seen) == ["0", "1"], completed.stdout + completed.stderr[-2000:]
    for text in seen.values():
        assert text.startswith("CollectiveMismatchError: DistributedOptimizer parameters differ across ranks")


@pytest.mark.timeout(200)
def test_dtype_mismatch_under_mpirun_stops_the_job():
    completed = launch("mpirun", 2, WORKERS / "misuse.py", "dtype", expect_ok=False, timeout=120)
    seen = outcomes(completed)
    assert completed.returncode != 0 and seen, completed.stdout + completed.stderr[-2000:]
    for text in seen.values():  # mpirun may stop the second rank before it prints
        assert "broadcast('weights': float64[3], root_rank=0)" in text


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])  # the allreduce on gloo, and on MPI
def test_skipped_collective_warns_naming_the_missing_rank_then_shuts_down(launcher):
    completed = launch(launcher, 2, WORKERS / "misuse.py", "stall", expect_ok=False, timeout=150,
                       env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "4"})
    assert completed.returncode != 0
    # rank 1 sleeps 120 s: the launcher stopped it when rank 0 shut down, before it could report an outcome
    assert sorted(outcomes(completed)) == ["0"], outcomes(completed)
    assert completed.left_behind == []
    warning = re.search(r"\[rank 0\] \[WARNING\] .*more than 2 seconds.*\nMissing ranks:\n1: \[skipped\]",
                        completed.stderr)
    assert warning, completed.stderr[-3000:]
    assert "1!: [skipped]" in completed.stderr and "Will shutdown." in completed.stderr
    assert "OUTCOME rank=0 HorovodInternalError: skipped stalled for more than 4 seconds" in completed.stdout

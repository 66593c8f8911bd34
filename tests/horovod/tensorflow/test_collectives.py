"""Every polytrain.horovod.tensorflow collective against Horovod's documented result, on real ranks.

One launch per configuration runs ``worker_collectives.py`` (every function once per rank);
``expected(rank, size)`` below is Horovod 0.28.1's documented result for each entry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest


def rows_of(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split: the first ``rows % size`` ranks get one more row."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def expected(r: int, n: int) -> dict:
    x = np.array([1.0, 2.0])
    mean = (n + 1) / 2
    total = n * (n + 1) // 2
    rows = np.arange((2 * n + 1) * 2, dtype=float).reshape(2 * n + 1, 2)
    counts = rows_of(2 * n + 1, n)
    start = sum(counts[:r])
    block = rows[start:start + counts[r]]
    offset = r * (r + 1) // 2
    weights = np.arange(total * 2, dtype=float).reshape(total, 2) + 1
    a2a_offset = r * (r + 1) // 2
    return {
        "avg": mean * x, "sum": total * x, "min": x, "max": n * x,
        "product": [math.factorial(n), math.factorial(n) * 2 ** n],
        "average_false": total * x, "scaled_sum": total * x * 0.5, "scaled_avg": 3 * mean * x,
        "int_sum": [total], "fp16": [list(mean * x), "float32"], "variable_sum": total * x,
        "sparse": [[[(s + 1.0) / n] for s in range(n)], list(range(n)), [[(s + 1.0) / n] for s in range(n)]],
        "grouped": [list(total * x), [n * (n - 1) // 2], [[0.5 * n * (n - 1) / 2]], ["float32", "int32", "float64"]],
        "allgather": [[float(s), float(s)] for s in range(n) for _ in range(s + 1)],
        "grouped_allgather": [[s for s in range(n) for _ in range(s + 1)], [[s] for s in range(n)]],
        "broadcast": n * x, "broadcast_inplace": x,
        "alltoall_even": [100 * s + 2 * r + j for s in range(n) for j in range(2)],
        "alltoall_splits": [[100 * s + a2a_offset + j for s in range(n) for j in range(r + 1)], [r + 1] * n],
        "reducescatter_sum": block * total, "reducescatter_avg": block * mean,
        "grouped_reducescatter": [block * total, block * total * 2],
        "tf_function": [list(total * x), [v for s in range(n) for v in (s + 1) * x], list(x)],
        "grad_allreduce_sum": 2 * n * (r + 1) * x, "grad_allreduce_avg": 2 * (r + 1) * x,
        "grad_allgather": weights[offset:offset + r + 1].sum(axis=0),
        "grad_broadcast": [mean, mean] if r == 0 else [0.0, 0.0],
        "grad_reducescatter": [n * (2 * n + 1)] * 2, "grad_alltoall": [n * (n + 1)] * 2,
        "broadcast_variables": [n - 1.0, [10.0 * (n - 1)] * 2],
        "broadcast_object": {"from": n - 1, "items": [n - 1, "x"]},
        "allgather_object": [["rank", s] for s in range(n)],
        "join": 0,
        **({"after_join": [7.0]} if r == 0 else {}),
    }


def close(got, want, where: str) -> None:
    """``got`` equals ``want``: numbers within 1e-6 (shapes too), strings and dicts exactly."""
    if isinstance(want, (str, dict)):
        assert got == want, where
        return
    try:
        g, w = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    except (TypeError, ValueError):  # ragged or mixed: compare item by item
        assert len(got) == len(want), f"{where}: {got} != {want}"
        for i, (gi, wi) in enumerate(zip(got, want)):
            close(gi, wi, f"{where}[{i}]")
        return
    assert g.shape == w.shape, f"{where}: {got} != {want}"
    np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=where)


def assert_matches(res: dict, r: int, n: int) -> None:
    for key, want in expected(r, n).items():
        close(res[key], want, f"rank {r} of {n}: {key}")
    assert res["basics"]["rank"] == r and res["basics"]["size"] == n
    assert res["basics"]["local_rank"] == r and res["basics"]["local_size"] == n
    assert res["basics"]["cross_rank"] == 0 and res["basics"]["cross_size"] == 1
    assert res["basics"]["is_homogeneous"] and res["basics"]["is_initialized"]
    assert res["basics"]["ops"] == [0, 1, 2, 3, 4, 5]  # Horovod's ReduceOp values
    assert res["mismatch_error"] or n == 1, "an allreduce of different shapes on different ranks must fail on every rank"


@pytest.mark.multiproc
@pytest.mark.timeout(400)
# three ranks, the uneven case; the same worker at two runs on real Horovod below and in the shim's examples
@pytest.mark.parametrize("nproc", [3])
def test_shim_collectives_under_mpirun(launch, nproc):
    proc = launch.mpirun(nproc, launch.here / "worker_collectives.py", impl="shim", timeout=360)
    per_rank = launch.results(proc, nproc)
    for r, res in enumerate(per_rank):
        assert res["impl"] == "polytrain" and res["basics"]["mpi_enabled"]
        assert_matches(res, r, nproc)
        assert "CollectiveError: ranks disagree on the size of this allreduce" in res["mismatch_error"]
        assert "Adasum" in res["adasum_error"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_shim_collectives_single_process_without_launcher(launch):
    proc = launch.single(launch.here / "worker_collectives.py", impl="shim", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = launch.results(proc, 1)
    assert res["impl"] == "polytrain" and not res["basics"]["mpi_enabled"]  # no MPI started for one process
    assert_matches(res, 0, 1)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_real_horovod_collectives_under_mpirun(launch, real_horovod):
    per_rank = launch.results(launch.mpirun(2, launch.here / "worker_collectives.py", impl="horovod",
                                            timeout=360), 2)
    for r, res in enumerate(per_rank):
        assert res["impl"] == "horovod"
        assert_matches(res, r, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_real_horovod_collectives_under_horovodrun_gloo(launch, real_horovod):
    per_rank = launch.results(launch.horovodrun(2, launch.here / "worker_collectives.py", timeout=360), 2)
    for r, res in enumerate(per_rank):
        assert res["impl"] == "horovod" and not res["basics"]["mpi_enabled"]
        assert_matches(res, r, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_shim_under_torchrun_fails_with_one_line(launch):
    """Without Horovod, collectives need an MPI launch: torchrun gets a one-line explanation."""
    from procs import BIN, free_port, run

    script = "import polytrain.horovod.tensorflow as hvd; hvd.init()"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "--no-python",
           str(BIN / "python"), "-c", script]
    proc = run(cmd, timeout=180, env=launch.env("shim"))
    assert proc.returncode != 0
    assert "BackendUnavailableError: polytrain.horovod.tensorflow without Horovod runs its collectives on MPI, " \
           "but this job was started by torchrun (2 processes)" in proc.stderr


STALLING = """
import sys, time
import tensorflow as tf
import polytrain.horovod.tensorflow as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(float(sys.argv[1]))
total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
print(f"RESULT {{\\"rank\\": {hvd.rank()}, \\"sum\\": {float(total[0])}}}", flush=True)
"""


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_shim_warns_about_a_stalled_rank_and_can_abort(launch, tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALLING)
    proc = launch.mpirun(2, script, "6", impl="shim", timeout=200, HOROVOD_STALL_CHECK_TIME_SECONDS="2")
    assert [res["sum"] for res in launch.results(proc, 2)] == [2.0, 2.0]  # a warning, not an error
    assert "[polytrain.horovod rank 0] waited 2 s for the other ranks to reach this allreduce" in proc.stderr

    from procs import BIN, run

    cmd = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", launch.python, str(script), "600"]
    aborted = run(cmd, timeout=200, env=launch.env("shim", HOROVOD_STALL_CHECK_TIME_SECONDS="1",
                                                   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3"))
    assert aborted.returncode != 0
    assert "stalled for more than 3 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); aborting the job" in aborted.stderr

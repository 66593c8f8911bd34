"""The MPI transport: fusion buckets, dtypes and polling (pure), fused averaging over real MPI processes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, loopback_env, run

from polytrain.comm.mpi_transport import (
    DEFAULT_FUSION_BYTES,
    REDUCIBLE,
    fusion_threshold,
    plan_buckets,
    wait,
    wire_dtype,
)
from polytrain.errors import EnvironmentDetectionError


def arrays(*specs: tuple[int, str]) -> list[np.ndarray]:
    return [np.zeros(n, dtype=dtype) for n, dtype in specs]


def test_threshold_from_environment() -> None:
    assert fusion_threshold({}) == DEFAULT_FUSION_BYTES == 64 * 1024 * 1024
    assert fusion_threshold({"POLYTRAIN_MPI_FUSION_BYTES": " 4096 "}) == 4096
    assert fusion_threshold({"POLYTRAIN_MPI_FUSION_BYTES": "0"}) == 0
    with pytest.raises(EnvironmentDetectionError, match="^POLYTRAIN_MPI_FUSION_BYTES='64MB' is not an integer"):
        fusion_threshold({"POLYTRAIN_MPI_FUSION_BYTES": "64MB"})
    with pytest.raises(EnvironmentDetectionError, match="^POLYTRAIN_MPI_FUSION_BYTES=-1 is negative"):
        fusion_threshold({"POLYTRAIN_MPI_FUSION_BYTES": "-1"})


def test_small_arrays_share_buckets_up_to_the_threshold() -> None:
    # 40 B, 40 B, 40 B (float32 ×10) with a 100 B threshold: two fit, the third starts a new bucket
    assert plan_buckets(arrays((10, "f4"), (10, "f4"), (10, "f4")), 100) == [[0, 1], [2]]
    assert plan_buckets(arrays((10, "f4"), (10, "f4")), 80) == [[0, 1]]  # exactly full


def test_large_arrays_go_alone_and_dtypes_never_mix() -> None:
    plan = plan_buckets(arrays((5, "f4"), (100, "f4"), (5, "f4"), (5, "f8"), (5, "f8")), 100)
    assert plan == [[0], [1], [2], [3, 4]]
    assert plan_buckets(arrays((5, "f4"), (5, "f4")), 0) == [[0], [1]]  # 0 = no fusion


def test_each_dtype_fills_its_own_bucket() -> None:
    # interleaved dtypes still fuse: one open bucket per dtype, buckets in the order of their first array
    assert plan_buckets(arrays((5, "f4"), (5, "f8"), (5, "f4"), (5, "f8")), 100) == [[0, 2], [1, 3]]
    # a large array closes its dtype's open bucket: later small ones start a new one
    assert plan_buckets(arrays((5, "f4"), (100, "f4"), (5, "f4")), 100) == [[0], [1], [2]]


def test_16_bit_floats_are_reduced_as_float32() -> None:
    assert wire_dtype(np.dtype("float16")) == np.float32
    assert wire_dtype(np.dtype("int16")) == np.int16 and wire_dtype(np.dtype("bool")) == np.bool_
    assert "float16" not in REDUCIBLE and "bool" not in REDUCIBLE and {"float32", "int64"} <= REDUCIBLE


class Request:
    """An MPI request that completes after ``tests`` calls of Test()."""

    def __init__(self, tests: int) -> None:
        self.left = tests

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.left -= 1
        return self.left < 0


def test_wait_spins_then_backs_off_and_reports_the_wait() -> None:
    waited: list[float] = []
    assert wait(Request(5), spins=3, on_wait=waited.append)
    assert len(waited) == 2  # tests 4 and 5 failed after the 3 spins: a sleep and a report each
    assert wait(Request(0), on_wait=waited.append) and len(waited) == 2  # done at once: no report


def test_wait_gives_up_after_the_timeout() -> None:
    assert wait(Request(10**9), spins=10**9, timeout=0.01) is False


WORKER = textwrap.dedent("""\
    import json, sys
    import numpy as np
    from polytrain.comm.mpi_transport import MpiCollectives
    from polytrain.environments import detect_world
    world = detect_world()
    mpi = MpiCollectives(world.rank, world.size, world.launcher, fusion_bytes=int(sys.argv[2]))
    r = world.rank
    grads = [np.full(3, 1.0 + r, np.float32), np.full((2, 2), 10.0 * r, np.float32),
             np.arange(40, dtype=np.float32) * (r + 1), np.full(2, r, np.float64)]
    calls = mpi.average_(grads)
    flat = np.concatenate([np.full(3, 1.0 + r), np.full(4, 10.0 * r), np.arange(40) * (r + 1)]).astype(np.float32)
    flat_calls = mpi.average_flat_(flat, [3, 4, 40])
    weights = [np.full(4, 7.0 + r, np.float32)]
    mpi.broadcast_(weights)
    out = {"calls": calls, "grads": [g.tolist() for g in grads], "weights": weights[0].tolist(),
           "flat_calls": flat_calls, "flat": flat.tolist(),
           "sum": mpi.all_reduce(np.array([r, 1.0])).tolist(), "max": mpi.all_reduce(np.array([r]), "max").tolist(),
           "gathered": mpi.all_gather_object({"rank": r}), "bcast": mpi.broadcast_object("from %d" % r, src=1)}
    open(sys.argv[1] + "/rank%d.json" % r, "w").write(json.dumps(out))
    """)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fusion", "calls", "flat_calls"), [(64, 3, 2), (0, 4, 3), (1 << 20, 2, 1)])
def test_fused_average_over_two_mpi_ranks(tmp_path: Path, fusion: int, calls: int, flat_calls: int) -> None:
    pytest.importorskip("mpi4py")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    check(run([str(BIN / "mpirun"), "--oversubscribe", "-np", "2", sys.executable, str(script), str(tmp_path),
               str(fusion)], env=loopback_env(), timeout=100))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]  # every rank ends with the same numbers
    out = results[0]
    # 64 B: [12 B, 16 B] fused, the 160 B array alone, the float64 alone → 3; 0: one each; 1 MiB: by dtype → 2
    assert out["calls"] == calls and out["flat_calls"] == flat_calls
    assert out["flat"] == [1.5] * 3 + [5.0] * 4 + (np.arange(40) * 1.5).tolist()  # packed: reduced in place
    assert out["grads"][0] == [1.5] * 3
    assert out["grads"][1] == [[5.0, 5.0], [5.0, 5.0]]
    assert out["grads"][2] == (np.arange(40) * 1.5).tolist()
    assert out["grads"][3] == [0.5, 0.5]
    assert out["weights"] == [7.0] * 4
    assert out["sum"] == [1.0, 2.0] and out["max"] == [1.0]
    assert out["gathered"] == [{"rank": 0}, {"rank": 1}] and out["bcast"] == "from 1"

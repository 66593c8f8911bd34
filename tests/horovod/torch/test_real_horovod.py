"""Where the real Horovod is installed: the shim gives the same numbers, check for check.

Both implementations run the same worker scripts under the same mpirun; every check
passes under both and every recorded value is identical.
"""

import pytest
from hvd_launch import WORKERS, failed_checks, launch, results

from polytrain.horovod.common import _import_error

pytestmark = pytest.mark.multiproc
if _import_error("horovod.torch") is not None:  # not importorskip: tests/horovod/torch would pass for it
    pytest.skip("real Horovod is not installed (scripts/build_horovod.sh)", allow_module_level=True)

DIFFERENT_BY_DESIGN = {"built", "adasum"}  # build flags; Adasum is refused by the shim


def both(script, **env):
    runs = {}
    for impl in ("shim", "horovod"):
        per_rank = results(launch("mpirun", 2, WORKERS / script,
                                  env={"POLYTRAIN_HOROVOD_IMPL": impl, "HOROVOD_DYNAMIC_PROCESS_SETS": "1", **env}))
        assert sorted(per_rank) == [0, 1] and failed_checks(per_rank) == {}, impl
        runs[impl] = per_rank
    return runs["shim"], runs["horovod"]


@pytest.mark.timeout(400)
def test_collectives_identical():
    shim, real = both("collectives.py")
    for rank in (0, 1):
        assert set(shim[rank]["checks"]) == set(real[rank]["checks"])
        same = {k: v for k, v in shim[rank]["values"].items() if k not in DIFFERENT_BY_DESIGN}
        assert same == {k: v for k, v in real[rank]["values"].items() if k not in DIFFERENT_BY_DESIGN}
    assert real[0]["values"]["built"][0] is True  # really Horovod (built with MPI)


@pytest.mark.timeout(400)
def test_distributed_optimizer_identical():
    shim, real = both("optimizer.py")
    for rank in (0, 1):
        assert set(real[rank]["checks"]) <= set(shim[rank]["checks"])
        for a, b in zip(shim[rank]["values"]["weights"], real[rank]["values"]["weights"]):
            assert a == pytest.approx(b, abs=1e-6)

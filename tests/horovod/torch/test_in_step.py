"""A failing op raises on every rank and leaves the ranks in step (the rule in polytrain.horovod.torch.pending).

workers/in_step.py provokes each kind of error on 2 ranks — checked alone (bad op, Adasum,
non-contiguous, splits, duplicate name, root), found in the metadata exchange (shape, dtype,
root, op, grouped, trailing dims, reducescatter, an async op refused while the next one
runs, a duplicate process set, different models), refused under join — and after each one
runs an allreduce, a process-set add/use/remove and a DistributedOptimizer step. It also
covers the ops Horovod's own test suite showed missing (bench/horovod_suite.py).
"""

import pytest
from hvd_launch import WORKERS, launch, results

pytestmark = pytest.mark.multiproc

LOCAL = {"unknown op": "ValueError", "adasum": "ValueError", "reducescatter adasum": "HorovodInternalError",
         "non-contiguous in place": "ValueError", "alltoall splits": "ValueError", "duplicate name": "ValueError",
         "root outside the set": "ValueError", "duplicate process set": "ValueError"}
EXCHANGED = {kind: "CollectiveMismatchError" for kind in (
    "shape mismatch", "dtype mismatch", "root mismatch", "different ops", "grouped mismatch",
    "allgather trailing dims", "reducescatter mismatch", "async mismatch", "different models")}
OPS = {"reducescatter sum", "reducescatter average", "reducescatter scaled", "reducescatter gradient",
       "grouped reducescatter gradient", "alltoall torch.int16", "alltoall torch.bool", "int16 allreduce",
       "sparse allreduce", "sparse embedding (sparse_as_dense=False)", "sparse embedding (sparse_as_dense=True)",
       "unnamed parameters averaged", "synchronize then step warns", "join returns the last rank",
       "async op submitted across a barrier"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])  # data on gloo, and on MPI
def test_every_error_raises_on_every_rank_and_the_job_goes_on(launcher):
    per_rank = results(launch(launcher, 2, WORKERS / "in_step.py", timeout=300))
    assert sorted(per_rank) == [0, 1]
    for rank, data in per_rank.items():
        assert {kind: data["errors"][kind] for kind in LOCAL} == LOCAL, rank
        assert {kind: data["errors"][kind] for kind in EXCHANGED} == EXCHANGED, rank
        failed = {name: detail for name, detail in data["checks"].items() if detail is not True}
        assert failed == {}, (rank, failed)
        after = {name for name in data["checks"] if name.startswith(("allreduce after", "optimizer step after"))}
        assert len(after) == 2 * (len(LOCAL) + len(EXCHANGED) + 1), sorted(after)  # + the join
        assert OPS <= set(data["checks"]), OPS - set(data["checks"])
    assert per_rank[0]["checks"]["op after a refused async op"] is True
    # rank 1 had joined: rank 0's allgather and broadcast were refused, its allreduce served with zeros
    assert per_rank[0]["errors"]["join then allgather"] == "CollectiveMismatchError"
    assert per_rank[0]["errors"]["join then broadcast"] == "CollectiveMismatchError"
    assert per_rank[0]["checks"]["allreduce while joined"] is True

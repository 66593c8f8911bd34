"""Every hvd.* collective on real gloo, against Horovod's documented results.

One launch per launcher runs workers/collectives.py, which computes each op and its
expected value on every rank; these tests assert that every check passed on every rank.
"""

import pytest
from hvd_launch import WORKERS, failed_checks, launch, results

pytestmark = pytest.mark.multiproc

EVERY_RANK = {
    "rank before init raises", "topology", "reduce op values", "allreduce average", "allreduce sum",
    "allreduce min", "allreduce max", "allreduce product", "allreduce int sum", "input unchanged",
    "prescale postscale sum", "prescale average", "deprecated average=False", "allreduce_ in place",
    "fp16 compression", "op and average raises", "async handle is int", "async sum", "async in place average",
    "synchronize twice is None", "grouped allreduce", "grouped allreduce_", "grouped allreduce async",
    "allgather uneven", "allgather async", "grouped allgather", "broadcast", "broadcast_ in place",
    "broadcast async", "alltoall", "alltoall splits", "alltoall received splits", "alltoall async",
    "reducescatter average", "reducescatter sum", "reducescatter uneven", "grouped reducescatter",
    "broadcast_object", "allgather_object", "allreduce gradient", "allgather gradient", "broadcast gradient",
    "join returns last joined rank",
}
PROCESS_SET_MEMBERS = {"process set allreduce", "process set rank", "process set allgather", "process set broadcast"}


def run_collectives(launcher, nproc, **env):
    per_rank = results(launch(launcher, nproc, WORKERS / "collectives.py", env=env))
    assert sorted(per_rank) == list(range(nproc))
    assert failed_checks(per_rank) == {}
    for data in per_rank.values():
        assert EVERY_RANK <= set(data["checks"]), EVERY_RANK - set(data["checks"])
        assert data["values"]["adasum"] == "ValueError"
    return per_rank


@pytest.mark.timeout(300)
def test_two_ranks_under_torchrun():
    per_rank = run_collectives("torchrun", 2)
    assert not per_rank[0]["values"]["mpi_enabled"]  # gloo carries everything under torchrun
    assert "allreduce while others joined" in per_rank[0]["checks"]
    assert per_rank[1]["values"]["allgather uneven"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]


@pytest.mark.timeout(300)
def test_three_ranks_under_mpirun_with_process_sets():
    per_rank = run_collectives("mpirun", 3)
    assert all(per_rank[rank]["values"]["mpi_enabled"] for rank in range(3))  # data and records over MPI
    for rank in (0, 2):
        assert PROCESS_SET_MEMBERS <= set(per_rank[rank]["checks"])
    assert not PROCESS_SET_MEMBERS & set(per_rank[1]["checks"])
    # sets passed to hvd.init() after a shutdown: {1, 2} reduces on ranks 1 and 2 only
    assert all("init process sets" in per_rank[rank]["checks"] for rank in range(3))
    assert ["init process set allreduce" in per_rank[rank]["checks"] for rank in range(3)] == [False, True, True]
    # 7 rows split 3/2/2: rank 2 gets rows 5 and 6, each summed over the factors 1+2+3
    assert per_rank[2]["values"]["reducescatter uneven"] == [30.0, 36.0]


@pytest.mark.timeout(300)
def test_horovodrun_gloo_environment_without_metadata_check():
    per_rank = run_collectives("horovodrun-env", 2, POLYTRAIN_HOROVOD_METADATA_CHECK="0")
    assert not per_rank[0]["values"]["mpi_enabled"]
    assert "allreduce while others joined" not in per_rank[0]["checks"]

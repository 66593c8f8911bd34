"""DistributedOptimizer, broadcast_parameters/optimizer_state and SyncBatchNorm on real gloo.

workers/optimizer.py compares n ranks x b samples with 1 process x n*b samples (and with
DDP) in the same launch; these tests assert every comparison held on every rank.
"""

import pytest
from hvd_launch import WORKERS, failed_checks, launch, results

pytestmark = pytest.mark.multiproc

CHECKS = {
    "2 ranks x b == 1 rank x 2b (SGD momentum)", "isinstance Optimizer",
    "state and param_groups", "Adam", "backward_passes_per_step=2",
    "synchronize + clip + skip_synchronize", "fp16 compression", "op=Sum", "gradient_predivide_factor",
    "groups=2", "equals DDP", "join returns the last rank", "sparse gradients allgathered", "sparse_as_dense", "zero_grad with pending allreduces raises", "step after synchronize warns",
    "too many backward passes raises", "duplicate names raise", "LR scheduler accepts it", "broadcast_parameters",
    "broadcast_optimizer_state scalars", "broadcast_optimizer_state created Adam state",
    "broadcast_optimizer_state tensors", "broadcast_optimizer_state leaves a stateless optimizer's weights",
    "broadcast_optimizer_state puts a stateless optimizer's gradients back",
    "SyncBatchNorm output", "SyncBatchNorm running stats",
    "SyncBatchNorm input gradient", "SyncBatchNorm weight gradient", "SyncBatchNorm eval",
}


def run_optimizer(launcher, nproc, **env):
    per_rank = results(launch(launcher, nproc, WORKERS / "optimizer.py", env=env))
    assert sorted(per_rank) == list(range(nproc))
    assert failed_checks(per_rank) == {}
    assert "optimizer step while others joined" in per_rank[0]["checks"]
    for data in per_rank.values():
        assert set(data["checks"]) - {"optimizer step while others joined"} == CHECKS
        assert data["values"]["2 ranks x b == 1 rank x 2b (SGD momentum)"] <= 1e-5
    return per_rank


@pytest.mark.timeout(300)
def test_two_ranks_torchrun_one_bucket():
    run_optimizer("torchrun", 2)


@pytest.mark.timeout(300)
def test_three_ranks_mpirun_many_small_buckets():
    run_optimizer("mpirun", 3, HOROVOD_FUSION_THRESHOLD="1024")

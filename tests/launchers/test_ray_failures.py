"""The ray launcher's failure line, from the text of Ray Train's own errors (as Ray 2.60 words them; the end-to-end
cases run in tests/multiproc/test_ray.py and tests/cluster/test_ray_cluster.py), and the failure handling it asks
Ray for."""

from __future__ import annotations

import pytest

from polytrain.launchers import ray as ray_launcher

UNPLACED = ("Training failed due to controller error: The worker group startup timed out after 10.0 seconds waiting "
            "for 2 workers. Potential causes include: (1) temporary insufficient cluster resources while waiting for "
            "autoscaling (ignore this warning in this case), (2) infeasible resource request ...")
RANKS = ("TrainingFailedError: worker group failed. RuntimeError: rank 1 on 10.0.0.2: python -m polytrain.cli "
         "train ... exited with code 1\n RuntimeError: rank 0 on 10.0.0.1: python -m polytrain.cli train ... exited "
         "with code -9")


def test_workers_that_cannot_be_placed_are_said_so_with_how_long_ray_waited() -> None:
    assert ray_launcher._failure_line(RuntimeError(UNPLACED)) == (
        "Ray could not place the 2 workers within 10 s: the cluster has no room for them (a node lost, or too few "
        "CPUs/GPUs free; `ray status` shows them); RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S on the cluster sets how "
        "long it waits")


def test_failed_ranks_are_named_each_once_with_their_node_and_exit_code() -> None:
    assert ray_launcher._failure_line(RuntimeError(RANKS + " " + RANKS)) == (
        "rank 0 on 10.0.0.1: python -m polytrain.cli train ... exited with code -9; "
        "rank 1 on 10.0.0.2: python -m polytrain.cli train ... exited with code 1")


@pytest.mark.slow
def test_max_restarts_also_bounds_the_retries_of_a_group_that_cannot_start() -> None:
    pytest.importorskip("ray.train")
    config = ray_launcher._failures(2)
    assert (config.max_failures, config.controller_failure_limit) == (2, 2)  # Ray's default -1 retries for ever

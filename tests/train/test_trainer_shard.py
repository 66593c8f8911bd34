"""The Trainer's sharded path, on the fakes (tests/trainer_runs.py): a backend that declares a `DataShard`, as a
model-parallel layout does (the ranks of a tensor/pipeline group read one shard of the data, and one of them
reports its loss and metrics). Four simulated ranks in two shards of two: the Trainer plans batches and scales the
learning rate by the shard count, not the world size, and adds only the reporting rank's sums to the job's totals.

The fake backend's ``all_reduce`` returns world size × its input (every simulated peer holding the same numbers),
so what a rank contributes is read from its inputs (``backend.reduced``): the fake framework's gradient vector
(21 values), a logging window's (loss sum, samples), an evaluation's (sum, count) pairs of loss and accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fakes import FakeJob
from trainer_runs import N_TRAIN, STEP_SIZES, epoch_order, fit, make_spec, manifest, records, sample_ids

from polytrain.protocols import DataShard
from polytrain.world import World

SHARDED = {"data": {"batch_size": 6}, "schedule": {"lr_scaling": "linear"}, "loop": {"epochs": 1}}


def world(rank: int) -> World:
    """Rank ``rank`` of 4 processes on one node: a layout with a data dimension of 2."""
    return World(rank=rank, size=4, local_rank=rank, local_size=4, launcher="torchrun")


def sharded(shard: DataShard) -> FakeJob:
    return FakeJob(backend_options={"data_shard": shard})


def windows(job: FakeJob) -> list[list[float]]:
    """The (loss sum, samples) of every logging window this rank put into the all-reduce."""
    return [r[:2].tolist() for r in job.be.reduced if r.shape == (3,)]  # the third: ranks asked to stop (0)


def evaluations(job: FakeJob) -> list[list[float]]:
    """The (loss sum, count, correct, count) of every evaluation this rank put into the all-reduce."""
    return [r.tolist() for r in job.be.reduced if r.shape == (4,)]


def test_batches_are_planned_by_the_shard_count_not_the_world_size(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_steps": 3}, **SHARDED)
    result, job = fit(spec, world(0), job=sharded(DataShard(count=2, index=0, reports=True)))
    calls = job.fw.calls.micro
    # a global batch of 6 × 2 shards: 7 steps of 12 samples (the last of 8), this shard taking half of each
    assert [c.count for c in calls] == [6] * 6 + [4]
    assert [c.loss_scale for c in calls] == [2 / 12] * 6 + [2 / 8]  # shards / samples in the step
    order = epoch_order(spec, 0)
    assert sample_ids(spec, calls) == [i for k, size in enumerate(STEP_SIZES) for i in order[k * 12:k * 12 + size // 2]]
    # the first of 2 validation shards (10 of the 20 samples), in ceil(10 / 6) = 2 batches
    assert job.fw.calls.evaluated == [5, 5]
    assert result.global_step == 7
    saved = manifest(spec, 6)
    assert (saved["global_batch"], saved["samples_in_epoch"], saved["world_size"]) == (12, 72, 4)
    model = json.loads((Path(spec.output) / "model.json").read_text())
    assert model["world_size"] == 4 and len(model["rank_state_digests"]) == 4


def test_the_second_shard_reads_the_other_half_of_each_step(tmp_path: Path) -> None:
    spec = make_spec(tmp_path / "out", **SHARDED)
    _, job = fit(spec, world(2), job=sharded(DataShard(count=2, index=1, reports=True)))
    order = epoch_order(spec, 0)
    assert sample_ids(spec, job.fw.calls.micro) == [i for k, size in enumerate(STEP_SIZES)
                                                    for i in order[k * 12 + size // 2:k * 12 + size]]
    assert job.fw.calls.evaluated == [5, 5]
    assert not Path(spec.output).exists()  # rank 2 writes nothing


def test_the_learning_rate_scales_by_the_shard_count(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_steps": 3}, **SHARDED)
    _, job = fit(spec, world(0), job=sharded(DataShard(count=2, index=0, reports=True)))
    assert job.fw.calls.lrs == [0.1] * 7  # lr 0.05 × 2 shards (linear scaling), not × 4 processes
    assert manifest(spec, 3)["lr"] == 0.1
    assert [r["lr"] for r in records(spec, "step")] == [0.1]


@pytest.mark.parametrize("reports", [True, False])
def test_only_the_reporting_rank_of_a_shard_counts_its_loss_and_metrics(tmp_path: Path, reports: bool) -> None:
    """Ranks 2 and 3 read the same shard; only rank 2 reports. Both run every micro-step and every evaluation
    batch (a layout's forward is collective), but rank 3 puts zeros into the sums."""
    spec = make_spec(tmp_path, loop={"epochs": 1, "log_every_n_steps": 1}, data={"batch_size": 6})
    rank = 2 if reports else 3
    _, job = fit(spec, world(rank), job=sharded(DataShard(count=2, index=1, reports=reports)))
    calls = job.fw.calls.micro
    order = epoch_order(spec, 0)
    assert sample_ids(spec, calls) == [i for k, size in enumerate(STEP_SIZES)
                                       for i in order[k * 12 + size // 2:k * 12 + size]]
    assert job.fw.calls.evaluated == [5, 5]
    if reports:
        assert windows(job) == [[c.loss_sum, c.count] for c in calls]  # one step per window
        (evaluation,) = evaluations(job)
        assert evaluation[1] == evaluation[3] == 10  # its 10 validation samples, loss and accuracy
        assert evaluation[0] > 0
    else:
        assert windows(job) == [[0.0, 0.0]] * 7
        assert evaluations(job) == [[0.0, 0.0, 0.0, 0.0]]
    assert sum(c.count for c in calls) == N_TRAIN // 2


def test_a_backend_without_a_layout_has_one_shard_per_rank(tmp_path: Path) -> None:
    """The default `DataShard(world size, rank)`: 4 ranks, each a quarter of each step, the lr × 4."""
    spec = make_spec(tmp_path, **SHARDED)
    _, job = fit(spec, world(0))
    assert job.be.data_shard == DataShard(4, 0, True)
    assert [c.count for c in job.fw.calls.micro] == [6, 6, 6, 2]  # steps of 24 samples, the last of 8
    assert job.fw.calls.lrs == [0.2] * 4
    assert job.fw.calls.evaluated == [5]  # ceil(ceil(20 / 4) / 6) = 1 batch of its 5

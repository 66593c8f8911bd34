"""The per-rank data plan: every sample exactly once per epoch, same samples for any world size."""

from __future__ import annotations

import numpy as np
import pytest

from polytrain.data import epoch_plan, eval_shard, load_dataset, steps_per_epoch
from polytrain.spec import DataSpec, SyntheticSpec


@pytest.mark.parametrize("n,batch,world,accum", [(1437, 32, 2, 1), (1437, 16, 3, 2), (100, 7, 4, 3), (5, 4, 3, 1)])
def test_every_sample_once_per_epoch_across_ranks(n: int, batch: int, world: int, accum: int) -> None:
    seen = []
    for rank in range(world):
        steps = list(epoch_plan(n, seed=3, epoch=1, global_batch=batch * world * accum, world_size=world, rank=rank,
                                accum=accum))
        assert len(steps) == steps_per_epoch(n, batch * world * accum)
        for plan in steps:
            assert len(plan.micro_batches) == accum
            seen.extend(np.concatenate(plan.micro_batches).tolist())
    assert sorted(seen) == list(range(n))


def test_step_covers_the_same_samples_for_any_split() -> None:
    """2 ranks × b, 1 rank × 2b and 1 rank × (2 micro-batches of b) use the same samples per step."""
    def step_sets(world: int, batch: int, accum: int) -> list[set[int]]:
        per_rank = [list(epoch_plan(200, seed=0, epoch=0, global_batch=batch * world * accum, world_size=world, rank=r,
                                    accum=accum))
                    for r in range(world)]
        return [set(np.concatenate([m for plans in per_rank for m in plans[i].micro_batches]).tolist())
                for i in range(len(per_rank[0]))]

    assert step_sets(2, 8, 1) == step_sets(1, 16, 1) == step_sets(1, 8, 2)


def test_shuffle_depends_on_epoch_and_seed() -> None:
    first = lambda seed, epoch: next(epoch_plan(50, seed=seed, epoch=epoch, global_batch=10, world_size=1, rank=0,
                                                accum=1)).micro_batches[0].tolist()
    assert first(0, 0) == first(0, 0)
    assert first(0, 0) != first(0, 1)
    assert first(0, 0) != first(1, 0)


def test_eval_shards_partition_the_validation_set() -> None:
    parts = [eval_shard(359, 3, r) for r in range(3)]
    assert np.concatenate(parts).tolist() == list(range(359))


def test_digits_is_real_and_split_deterministically() -> None:
    a, b = load_dataset(DataSpec(), seed=0), load_dataset(DataSpec(), seed=0)
    assert a.x_train.shape[1] == 64 and a.info.num_outputs == 10 and a.info.image_shape == (1, 8, 8)
    assert len(a.x_train) + len(a.x_val) == 1797 and len(a.x_val) == 359
    assert np.array_equal(a.y_val, b.y_val) and 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_synthetic_and_npz(tmp_path) -> None:
    reg = load_dataset(DataSpec(name="synthetic", synthetic=SyntheticSpec(task="regression", samples=100)), seed=1)
    assert reg.info.task == "regression" and reg.info.num_outputs == 1 and reg.y_train.dtype == np.float32
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((10, 1, 4, 4)), y=np.arange(10) % 3)
    d = load_dataset(DataSpec(name="npz", path=str(path), val_fraction=0.2), seed=0)
    assert d.info.image_shape == (1, 4, 4) and d.info.num_outputs == 3 and len(d.x_val) == 2

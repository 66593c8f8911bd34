"""The per-rank data plan: every sample exactly once per epoch, same samples for any world size."""

from __future__ import annotations

import numpy as np
import pytest

from polytrain.data import epoch_plan, eval_shard, global_batch_size, load_dataset, steps_per_epoch
from polytrain.data.live import data_from_objects
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec, SyntheticSpec


def test_a_step_takes_batch_size_times_world_times_accumulation_unless_fixed() -> None:
    """The planner takes numbers (data.batch_size, the data-parallel degree, loop.grad_accum_steps and
    data.global_batch_size), not a spec."""
    assert global_batch_size(32, 3, 2) == 192
    assert global_batch_size(32, 3, 2, fixed=None) == 192
    assert [global_batch_size(32, world, accum, fixed=100) for world, accum in ((1, 1), (4, 3))] == [100, 100]


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


def test_npz_takes_data_classes(tmp_path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((10, 3)), y=np.arange(10) % 3)
    assert load_dataset(DataSpec(name="npz", path=str(path), classes=5), seed=0).info.num_outputs == 5
    with pytest.raises(SpecError, match=r"^data.path: .*d.npz: y has label 2, not below data.classes 2$"):
        load_dataset(DataSpec(name="npz", path=str(path), classes=2), seed=0)


@pytest.mark.parametrize(("x", "y", "message"), [
    (np.array([[1.0], [np.nan], [2.0]]), np.array([0, 1, 0]),
     "train_data: x holds NaN or Inf (or a value float32 cannot hold) at sample 1; values must be finite numbers"),
    (np.array([[1.0], [1e39], [2.0]]), np.array([0, 1, 0]), "train_data: x holds NaN or Inf"),
    (np.ones((3, 1)), np.array([0.5, np.inf, 1.0]), "train_data: y holds NaN or Inf (or a value float32 cannot hold) "
     "at sample 1"),
    (np.ones((3, 1)), np.array([0, 1, 2**40]), "train_data: y has label 1099511627776; without data.classes labels "
     "must be below 1048576 (set data.classes if the model really needs 1099511627777 outputs)"),
    (np.array([[1, 2], [3, 2**40]]), np.array([[2, 3], [2**40, 4]]), "train_data: x or y has token id 1099511627776"),
])
def test_arrays_given_to_fit_must_be_finite_and_labels_sane(x: np.ndarray, y: np.ndarray, message: str) -> None:
    with pytest.raises(SpecError) as info:
        data_from_objects((x, y), None, DataSpec(), seed=0)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_part_is_what_array_split_gives() -> None:
    """The step plan's cut (every step) is numpy's array_split, the longer parts first, empty parts included."""
    from polytrain.data.plan import part

    for n in (0, 1, 5, 63, 64, 65, 130):
        items = np.arange(100, 100 + n)
        for parts in (1, 2, 3, 4, 7, 64):
            expected = np.array_split(items, parts)
            for index in range(parts):
                np.testing.assert_array_equal(part(items, parts, index), expected[index])
                assert np.shares_memory(part(items, parts, index), items) or len(expected[index]) == 0

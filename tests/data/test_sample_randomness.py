"""Per-sample randomness: a sample's augmentation and the user's transform draw from that sample's own
Generator, seeded by (seed, epoch, its index in the training source), through the real planner and the real
prefetcher — so a sample looks the same at world size 1 and 2, at any micro-batch split and after a resume,
and two ranks do not draw alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from polytrain.data.plan import epoch_plan
from polytrain.data.prefetch import Prefetcher, Transform
from polytrain.data.source import ArraySource, Data, Source
from polytrain.spec.tables import AugmentSpec, DataSpec

Image = pytest.importorskip("PIL.Image")

from polytrain.data.images import open_images  # noqa: E402

SEED, H, W = 3, 6, 7


def image_tree(root: Path, n: int = 40) -> Path:
    """Two class folders of grey images no two alike and none mirror-symmetric (so a flip shows)."""
    for i in range(n):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = ((np.arange(H * W).reshape(H, W) * 5 + 3 * i) % 200 + np.arange(W)[None, :] * 7).astype(np.uint8)
        pixels[0, 0] = i
        Image.fromarray(pixels, "L").save(folder / f"img{i:03d}.png")
    return root


def augmented_images(tmp_path: Path, crop_padding: int = 1) -> Data:
    spec = DataSpec(name="images", path=str(image_tree(tmp_path / "tree")), channels=1, val_fraction=0.0,
                    workers=0, augment=AugmentSpec(crop_padding=crop_padding, horizontal_flip=True))
    data = open_images(spec, seed=SEED)
    assert data.augment is not None
    return data


def per_sample(source: Source, prefetcher: Prefetcher, *, world: int, accum: int, epoch: int, global_batch: int,
               start_step: int = 0) -> tuple[dict[int, np.ndarray], list[list[np.ndarray]]]:
    """What each sample index became in one epoch (every rank's micro-batches through the prefetcher), and
    per step, each rank's samples in the order they came."""
    out: dict[int, np.ndarray] = {}
    steps: dict[int, list[np.ndarray]] = {}
    for rank in range(world):
        plans = epoch_plan(len(source), seed=SEED, epoch=epoch, global_batch=global_batch, world_size=world,
                           rank=rank, accum=accum, start_step=start_step, order=source.order(SEED, epoch))
        for step, (plan, batches) in enumerate(prefetcher.steps(source, enumerate(plans), epoch)):
            mine = []
            for indices, (x, _) in zip(plan.micro_batches, batches):
                assert len(x) == len(indices)
                for i, row in zip(indices.tolist(), x):
                    assert i not in out, "each sample once per epoch"
                    out[i] = row
                    mine.append(row)
            steps.setdefault(step, []).append(np.asarray(mine))
    return out, [steps[s] for s in sorted(steps)]


def test_a_sample_is_augmented_alike_at_world_size_1_and_2_and_after_a_resume(tmp_path: Path) -> None:
    data = augmented_images(tmp_path)
    prefetcher = Prefetcher(workers=2, depth=2, seed=SEED, augment=data.augment)
    try:
        one, _ = per_sample(data.train, prefetcher, world=1, accum=2, epoch=1, global_batch=8)
        two, _ = per_sample(data.train, prefetcher, world=2, accum=1, epoch=1, global_batch=8)
        three, _ = per_sample(data.train, prefetcher, world=3, accum=2, epoch=1, global_batch=12)
        resumed, _ = per_sample(data.train, prefetcher, world=2, accum=2, epoch=1, global_batch=8, start_step=2)
        other_epoch, _ = per_sample(data.train, prefetcher, world=1, accum=1, epoch=2, global_batch=8)
    finally:
        prefetcher.close()
    assert sorted(one) == sorted(two) == sorted(three) == list(range(40))
    for i in range(40):
        np.testing.assert_array_equal(one[i], two[i], err_msg=f"sample {i}")
        np.testing.assert_array_equal(one[i], three[i], err_msg=f"sample {i}")
    assert sorted(resumed) != sorted(one)  # the first two steps were skipped ...
    for i, row in resumed.items():  # ... and the rest look as in the straight epoch
        np.testing.assert_array_equal(row, one[i], err_msg=f"sample {i}")
    plain = data.train.read(np.arange(40))[0]
    assert sum(not np.array_equal(one[i], plain[i]) for i in range(40)) > 20, "augmentation happened"
    assert sum(not np.array_equal(one[i], other_epoch[i]) for i in range(40)) > 20, "another epoch, other draws"


def flips(rows: np.ndarray, plain: np.ndarray) -> list[bool]:
    """Which augmented rows (no crop) are their original mirrored."""
    out = []
    for row, original in zip(rows.reshape(-1, H, W), plain.reshape(-1, H, W)):
        assert np.array_equal(row, original) or np.array_equal(row, original[:, ::-1])
        out.append(bool(np.array_equal(row, original[:, ::-1])))
    return out


def test_two_ranks_do_not_draw_the_same_flips(tmp_path: Path) -> None:
    data = augmented_images(tmp_path, crop_padding=0)
    prefetcher = Prefetcher(workers=0, depth=1, seed=SEED, augment=data.augment)
    straight, by_step = per_sample(data.train, prefetcher, world=2, accum=1, epoch=0, global_batch=8)
    order = data.train.order(SEED, 0)
    plain = data.train.read(np.arange(40))[0]
    pattern = {0: [], 1: []}  # rank -> its flips, position by position, over the epoch
    for step, ranks in enumerate(by_step):
        for rank, rows in enumerate(ranks):
            chunk = np.array_split(order[step * 8:(step + 1) * 8], 2)[rank]
            pattern[rank] += flips(rows, plain[chunk])
    assert len(pattern[0]) == len(pattern[1]) == 20
    assert pattern[0] != pattern[1], "rank 1 drew rank 0's flips"
    assert 0 < sum(pattern[0] + pattern[1]) < 40
    assert len(straight) == 40


def noise_transform(kind: str, calls: list[int]) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """A transform that appends two draws per sample and records the batch sizes it was called with."""
    if kind == "rng":
        def fn(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
            calls.append(len(x))
            return np.concatenate([x, rng.random((len(x), 2), dtype=np.float32)], axis=1), y
        return fn

    def fn_rngs(x: np.ndarray, y: np.ndarray, rngs: list[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(x))
        assert len(rngs) == len(x)
        extra = np.array([r.random(2, dtype=np.float32) for r in rngs], dtype=np.float32).reshape(len(x), 2)
        return np.concatenate([x, extra], axis=1), y
    return fn_rngs


@pytest.mark.parametrize("kind", ["rng", "rngs"])
def test_a_transform_draws_alike_for_a_sample_whatever_batch_it_lands_in(kind: str) -> None:
    x = np.arange(60, dtype=np.float32).reshape(30, 2)
    source = ArraySource(x, np.arange(30) % 3)
    calls: list[int] = []
    prefetcher = Prefetcher(workers=0, depth=1, seed=SEED, transform=Transform(noise_transform(kind, calls)))
    a, ya = prefetcher.read(source, np.array([4, 9, 17, 2]), epoch=1, train=True)
    b, yb = prefetcher.read(source, np.array([17, 5, 4]), epoch=1, train=True)
    assert calls == ([1] * 7 if kind == "rng" else [4, 3])  # rng: once per sample, a batch of one
    np.testing.assert_array_equal(a[:, :2], x[[4, 9, 17, 2]])
    np.testing.assert_array_equal(ya, [1, 0, 2, 2])
    np.testing.assert_array_equal(a[2], b[0])  # sample 17
    np.testing.assert_array_equal(a[0], b[2])  # sample 4
    assert not np.array_equal(a[0, 2:], a[1, 2:])
    # the draws are those of the sample's Generator: (seed, training stream, epoch, index)
    np.testing.assert_array_equal(a[1, 2:], np.random.default_rng([SEED, 0, 1, 9]).random(2, dtype=np.float32))
    again, _ = prefetcher.read(source, np.array([4]), epoch=2, train=True)
    val, _ = prefetcher.read(source, np.array([4]), epoch=1, train=False)
    assert not np.array_equal(again[0, 2:], a[0, 2:]) and not np.array_equal(val[0, 2:], a[0, 2:])
    empty, y_empty = prefetcher.read(source, np.zeros(0, dtype=np.int64), epoch=1, train=True)
    assert empty.shape == (0, 4) and len(y_empty) == 0  # the transform's shape, on an empty micro-batch


def test_a_transform_at_world_size_1_and_2_through_the_planner() -> None:
    """Every sample of an epoch gets the same transform draws when the world size changes the batches."""
    x = np.arange(46, dtype=np.float32)[:, None]
    source = ArraySource(x, np.zeros(46, dtype=np.int64))
    prefetcher = Prefetcher(workers=2, depth=2, seed=SEED, transform=Transform(noise_transform("rng", [])))
    try:
        one, _ = per_sample(source, prefetcher, world=1, accum=1, epoch=0, global_batch=6)
        two, _ = per_sample(source, prefetcher, world=2, accum=3, epoch=0, global_batch=6)
    finally:
        prefetcher.close()
    assert sorted(one) == sorted(two) == list(range(46))
    for i in range(46):
        np.testing.assert_array_equal(one[i], two[i])
        assert one[i][0] == i


def test_a_transform_without_rng_runs_once_per_batch_and_is_checked() -> None:
    source = ArraySource(np.ones((8, 3), dtype=np.float32), np.zeros(8, dtype=np.int64))
    calls: list[int] = []

    def double(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(x))
        return x * 2, y

    x, _ = Prefetcher(0, 1, SEED, transform=Transform(double)).read(source, np.arange(5), epoch=0, train=True)
    assert calls == [5] and float(x.sum()) == 30.0
    from polytrain.errors import SpecError

    bad = Transform(lambda x, y, rng: x, "data.transform")
    with pytest.raises(SpecError, match=r"^data.transform: must return \(x, y\) numpy arrays, got a ndarray$"):
        Prefetcher(0, 1, SEED, transform=bad).read(source, np.arange(2), epoch=0, train=True)

"""data.name: parquet — real Parquet files written with pyarrow, read back row group by row group."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
from specs import data_spec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from polytrain.data.parquet import ParquetSource, open_parquet  # noqa: E402
from polytrain.data.source import Subset  # noqa: E402


def write(path: Path, ids: np.ndarray, row_group_size: int = 16, list_type: str = "fixed") -> Path:
    """Rows whose features and labels are functions of the row's id."""
    arrays = np.stack([ids, ids + 0.5, -ids], axis=1).astype(np.float32)
    value_type = pa.list_(pa.float32(), 3) if list_type == "fixed" else pa.list_(pa.float32())
    table = pa.table({
        "id": pa.array(ids, pa.int64()),
        "half": pa.array(ids * 0.5, pa.float32()),
        "mod": pa.array(ids % 7, pa.float64()),
        "vec": pa.array(list(arrays), value_type),
        "label": pa.array(ids % 3, pa.int64()),
        "target": pa.array(ids * 0.25, pa.float32()),
        "name": pa.array([f"row {i}" for i in ids]),
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


spec = partial(data_spec, "parquet", features=("id", "half", "mod"), label="label", shuffle_window=2)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Three files of 50, 37 and 64 rows (row groups of 16: some short ones), ids 0..150."""
    root = tmp_path / "table"
    root.mkdir()
    write(root / "part-0.parquet", np.arange(0, 50))
    write(root / "part-1.parquet", np.arange(50, 87))
    write(root / "part-2.parquet", np.arange(87, 151))
    (root / "_SUCCESS").write_text("")  # what Spark leaves beside its files: not a Parquet file
    return root


def test_values_read_back_sample_by_sample(folder: Path) -> None:
    source = ParquetSource(sorted(folder.glob("*.parquet")), ("id", "half", "mod"), "label", window=2, field="path")
    assert len(source) == 151 and len(source.groups) == 4 + 3 + 4
    indices = np.random.default_rng(0).permutation(151)
    x, y = source.read(indices)
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (151, 3)
    np.testing.assert_array_equal(x[:, 0], indices)
    np.testing.assert_array_equal(x[:, 1], indices * 0.5)
    np.testing.assert_array_equal(x[:, 2], indices % 7)
    np.testing.assert_array_equal(y, indices % 3)


@pytest.mark.parametrize("list_type", ["fixed", "variable"])
def test_one_column_of_arrays(tmp_path: Path, list_type: str) -> None:
    path = write(tmp_path / "t.parquet", np.arange(40), list_type=list_type)
    data = open_parquet(spec(path, features=("vec",), label="target", val_fraction=0.0), seed=0)
    assert data.info.input_shape == (3,) and data.info.task == "regression" and data.info.num_outputs == 1
    x, y = data.train.read(np.array([3, 0, 39]))
    np.testing.assert_array_equal(x, [[3, 3.5, -3], [0, 0.5, 0], [39, 39.5, -39]])
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [0.75, 0, 9.75])


def test_info_from_the_label_column(folder: Path) -> None:
    data = open_parquet(spec(folder), seed=0)
    assert data.info.input_shape == (3,) and data.info.task == "classification" and data.info.num_outputs == 3
    assert open_parquet(spec(folder, classes=10), seed=0).info.num_outputs == 10
    assert "row groups permuted" in data.guarantee and "windows of 2" in data.guarantee


def test_label_range_without_statistics(tmp_path: Path) -> None:
    """A writer that leaves no statistics: the label column is read, row group by row group."""
    ids = np.arange(30)
    pq.write_table(pa.table({"id": ids, "label": ids % 4}), tmp_path / "t.parquet", row_group_size=8,
                   write_statistics=False)
    data = open_parquet(spec(tmp_path / "t.parquet", features=("id",)), seed=0)
    assert data.info.num_outputs == 4


def test_a_glob_and_a_single_file(folder: Path) -> None:
    assert len(open_parquet(spec(folder / "part-[01].parquet", val_fraction=0.0), seed=0).train) == 87
    assert len(open_parquet(spec(folder / "part-2.parquet", val_fraction=0.0), seed=0).train) == 64


def test_val_path_or_val_fraction(folder: Path, tmp_path: Path) -> None:
    val_file = write(tmp_path / "val.parquet", np.arange(1000, 1010))
    data = open_parquet(spec(folder, val_path=str(val_file)), seed=0)
    assert len(data.train) == 151 and len(data.val) == 10
    np.testing.assert_array_equal(data.val.read(np.arange(10))[0][:, 0], np.arange(1000, 1010))

    split = open_parquet(spec(folder, val_fraction=0.2), seed=3)
    assert isinstance(split.train, Subset) and len(split.val) == 30 and len(split.train) == 121
    train_ids = set(split.train.read(np.arange(121))[0][:, 0].astype(int).tolist())
    val_ids = set(split.val.read(np.arange(30))[0][:, 0].astype(int).tolist())
    assert not train_ids & val_ids and train_ids | val_ids == set(range(151))
    again = open_parquet(spec(folder, val_fraction=0.2), seed=3)
    np.testing.assert_array_equal(again.val.read(np.arange(30))[0], split.val.read(np.arange(30))[0])


def test_exactly_once_across_ranks_and_micro_steps(folder: Path, exactly_once) -> None:
    data = open_parquet(spec(folder), seed=0)
    ids = lambda x, y: x[:, 0].astype(int)
    whole = ParquetSource(sorted(folder.glob("*.parquet")), ("id", "half", "mod"), "label", window=2, field="path")
    exactly_once(whole, ids, list(range(151)))
    exactly_once(data.train, ids, data.train.read(np.arange(len(data.train)))[0][:, 0].astype(int).tolist())


def test_order_keeps_row_groups_together(folder: Path) -> None:
    """A window of 2 row groups (of at most 16 rows): each row group's rows lie within 32 consecutive positions
    of the epoch's order, where a full shuffle would spread them over all 151."""
    source = ParquetSource(sorted(folder.glob("*.parquet")), ("id",), "label", window=2, field="path")
    for epoch in range(3):
        groups = np.searchsorted(source.starts, source.order(0, epoch), side="right") - 1
        for g in range(len(source.groups)):
            where = np.flatnonzero(groups == g)
            assert where.max() - where.min() < 32


def test_the_cache_stays_bounded_and_is_reused(folder: Path) -> None:
    source = ParquetSource(sorted(folder.glob("*.parquet")), ("id",), "label", window=2, field="path")
    order = source.order(0, 0)
    for start in range(0, len(order), 8):
        source.read(order[start:start + 8])
    assert len(source._cache._items) <= source._cache.capacity == 4
    assert source._cache.decodes == len(source.groups)  # once per row group and epoch, even across windows


def test_reading_from_threads_gives_the_same_batches(folder: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    source = ParquetSource(sorted(folder.glob("*.parquet")), ("id",), "label", window=1, field="path")
    order = source.order(1, 0)
    chunks = [order[i:i + 7] for i in range(0, len(order), 7)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(source.read, chunks))
    for chunk, (x, _) in zip(chunks, results):
        np.testing.assert_array_equal(x[:, 0], chunk)

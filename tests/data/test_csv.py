"""data.name: csv — comma-separated files with a header row, read back row by row by byte offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polytrain.data.csv import CsvSource, open_csv
from polytrain.spec import DataSpec


def write(path: Path, ids: range, newline: str = "\n", float_labels: bool = False) -> Path:
    """Rows whose values are functions of the row's id; a quoted text column holds commas."""
    lines = ["id,note,a,b,label"]
    for i in ids:
        label = f"{i * 0.25}" if float_labels else str(i % 4)
        lines.append(f'{i},"row {i}, quoted",{i * 0.5},{-i},{label}')
        if i % 10 == 3:
            lines.append("")  # a blank line is no row
    path.write_text(newline.join(lines) + newline, newline="")
    return path


def spec(path: Path, **fields: object) -> DataSpec:
    base: dict[str, object] = {"name": "csv", "path": str(path), "features": ("id", "a", "b"), "label": "label"}
    return DataSpec(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_values_read_back_sample_by_sample(tmp_path: Path, newline: str) -> None:
    source = CsvSource([write(tmp_path / "t.csv", range(60), newline)], ("id", "a", "b"), "label", "path")
    assert len(source) == 60
    indices = np.random.default_rng(0).permutation(60)
    x, y = source.read(indices)
    assert x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, np.stack([indices, indices * 0.5, -indices], axis=1))
    np.testing.assert_array_equal(y, indices % 4)


def test_no_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,label\n1,0\n2,1")
    x, y = CsvSource([path], ("a",), "label", "path").read(np.array([1, 0]))
    np.testing.assert_array_equal(x[:, 0], [2, 1])
    np.testing.assert_array_equal(y, [1, 0])


def test_info_and_float_labels(tmp_path: Path) -> None:
    data = open_csv(spec(write(tmp_path / "t.csv", range(40))), seed=0)
    assert (data.info.input_shape, data.info.num_outputs, data.info.task) == ((3,), 4, "classification")
    assert data.guarantee == "every row once per epoch, fully shuffled"
    reg = open_csv(spec(write(tmp_path / "r.csv", range(40), float_labels=True), val_fraction=0.0), seed=0)
    assert (reg.info.num_outputs, reg.info.task) == (1, "regression")
    x, y = reg.train.read(np.array([5]))
    assert y.dtype == np.float32 and y[0] == 1.25


def test_val_path_or_val_fraction(tmp_path: Path) -> None:
    train = write(tmp_path / "train.csv", range(50))
    val = write(tmp_path / "val.csv", range(100, 110))
    data = open_csv(spec(train, val_path=str(val)), seed=0)
    assert len(data.train) == 50 and len(data.val) == 10
    np.testing.assert_array_equal(data.val.read(np.arange(10))[0][:, 0], np.arange(100, 110))
    split = open_csv(spec(train, val_fraction=0.2), seed=1)
    assert (len(split.train), len(split.val)) == (40, 10)
    ids = split.train.read(np.arange(40))[0][:, 0].tolist() + split.val.read(np.arange(10))[0][:, 0].tolist()
    assert sorted(ids) == list(range(50))


def test_a_directory_of_files(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a.csv", range(0, 20))
    write(tmp_path / "d" / "b.csv", range(20, 45))
    data = open_csv(spec(tmp_path / "d", val_fraction=0.0), seed=0)
    np.testing.assert_array_equal(data.train.read(np.arange(45))[0][:, 0], np.arange(45))


def test_exactly_once_across_ranks_and_micro_steps(tmp_path: Path, exactly_once) -> None:
    data = open_csv(spec(write(tmp_path / "t.csv", range(83))), seed=0)
    ids = lambda x, y: x[:, 0].astype(int)
    exactly_once(data.train.parent, ids, list(range(83)))
    exactly_once(data.train, ids, data.train.read(np.arange(len(data.train)))[0][:, 0].astype(int).tolist())


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_quoted_fields_may_hold_line_breaks_and_doubled_quotes(tmp_path: Path, newline: str) -> None:
    """A quoted value spanning lines is one row (what pandas' to_csv writes for text with line breaks)."""
    rows = [f'{i},"line one of {i}{newline}line ""two""{newline}{newline}three",{i * 0.5},{-i},{i % 3}'
            if i % 2 else f'{i},"plain, {i}",{i * 0.5},{-i},{i % 3}' for i in range(25)]
    path = tmp_path / "t.csv"
    path.write_text(newline.join(["id,note,a,b,label", *rows]) + newline, newline="")
    source = CsvSource([path], ("id", "a", "b"), "label", "path")
    assert len(source) == 25
    indices = np.random.default_rng(1).permutation(25)
    x, y = source.read(indices)
    np.testing.assert_array_equal(x, np.stack([indices, indices * 0.5, -indices], axis=1))
    np.testing.assert_array_equal(y, indices % 3)
    note = source.files[0].rows(np.array([3]))[0][1]
    assert note == f"line one of 3{newline}line \"two\"{newline}{newline}three"

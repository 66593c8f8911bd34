"""data.name: csv — comma-separated files with a header row, read back row by row by byte offset."""

from __future__ import annotations

import csv
import io
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specs import data_spec

from polytrain.data.csv import CsvSource, open_csv, records
from polytrain.errors import SpecError


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


spec = partial(data_spec, "csv", features=("id", "a", "b"), label="label")


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


# --------------------------------------------------------------------------- record boundaries: the csv module's

def _is_blank(values: list[str]) -> bool:
    return not values or (len(values) == 1 and not values[0].strip())


def _csv_module(text: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(text, newline="")) if not _is_blank(r)]


def _check_like_the_csv_module(tmp_path: Path, text: str) -> None:
    """`records` finds what ``csv.reader`` over the whole file finds, and each record's bytes alone parse to it."""
    path = tmp_path / "t.csv"
    path.write_bytes(text.encode("utf-8"))
    # a quoted field open at the end: an extra line break goes into it instead of being a blank line
    extended = list(csv.reader(io.StringIO(text + "\n", newline="")))
    if extended and extended[-1] == [] and not text.endswith("\r"):  # a blank line (a lone \r became \r\n)
        extended.pop()
    unclosed = extended != list(csv.reader(io.StringIO(text, newline="")))
    with open(path, "rb") as handle:
        if unclosed:
            with pytest.raises(SpecError, match=r"^data.path: (row \d+|the header row) of .*t.csv opens a quoted "
                                                 r"field that never closes$"):
                list(records(handle, path, "path"))
            return
        found = list(records(handle, path, "path"))
    assert [values for _, _, values in found] == _csv_module(text)
    data = path.read_bytes()
    for (start, end, values), (after, _, _) in zip(found, found[1:] + [(len(data), 0, [])]):
        assert start < end <= after
        assert next(csv.reader([data[start:end].decode("utf-8")])) == values


@pytest.mark.parametrize("text", [
    'a,label\n1,5" screen,0\n',  # a quote inside an unquoted field is a character ...
    'a,label\n1,5" screen\n2,6" x\n3,7\n',  # ... two of them do not merge records
    'a,b\n"x""y",1\n"multi\nline ""quoted""\r\n",2\r\n',
    'a,b\n"ab"cd"e,1\n2,2',  # text after a closing quote joins the field; no final newline
    'a,b\r1,2\r3,4\r',  # lone carriage returns end records, as in a file opened with newline=""
    'a,b\n1,"open\n2,3\n',  # never closes
    'a,b\n\n  \n1,2\n\n',  # blank and whitespace-only lines are no records
    'a,b\n"",""\n"\r",x\n',
])
def test_records_like_the_csv_module(tmp_path: Path, text: str) -> None:
    _check_like_the_csv_module(tmp_path, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(['a', '1', ',', '"', '""', '\n', '\r\n', '\r', ' ', 'é']), max_size=40))
def test_records_like_the_csv_module_property(tmp_path: Path, parts: list[str]) -> None:
    _check_like_the_csv_module(tmp_path, "".join(parts))


def test_a_quote_inside_an_unquoted_field_is_read(tmp_path: Path) -> None:
    """What a valid file with inch marks in a text column reads as (it was refused, or two rows merged)."""
    path = tmp_path / "t.csv"
    path.write_text('a,note,label\n1,5" screen,0\n2,plain,1\n3,6" screen,0\n4,"quoted, ""x""",1\n')
    source = CsvSource([path], ("a",), "label", "path")
    assert len(source) == 4
    x, y = source.read(np.arange(4))
    np.testing.assert_array_equal(x[:, 0], [1, 2, 3, 4])
    np.testing.assert_array_equal(y, [0, 1, 0, 1])
    assert [r[1] for r in source.files[0].rows(np.arange(4))] == ['5" screen', "plain", '6" screen', 'quoted, "x"']


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes("a,label\n1,0\n".encode("utf-8-sig"))
    x, y = CsvSource([path], ("a",), "label", "path").read(np.array([0]))
    assert (x[0, 0], y[0]) == (1.0, 0)


def test_a_field_over_128_kib_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    big = "x" * 300_000
    path.write_text(f'a,note,label\n1,"{big}",0\n2,{big},1\n')
    source = CsvSource([path], ("a",), "label", "path")
    x, y = source.read(np.array([1, 0]))
    np.testing.assert_array_equal(x[:, 0], [2, 1])
    assert source.files[0].rows(np.array([0]))[0][1] == big


def test_a_csv_error_is_one_line_naming_file_and_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import polytrain.data.csv as csv_source

    path = tmp_path / "t.csv"
    path.write_text(f"a,note,label\n1,x,0\n2,{'y' * 50},1\n")
    old = csv.field_size_limit(20)
    monkeypatch.setattr(csv_source, "_FIELD_LIMIT", 20)
    try:
        with pytest.raises(SpecError) as caught:
            CsvSource([path], ("a",), "label", "path")
    finally:
        csv.field_size_limit(old)
    assert str(caught.value) == (f"data.path: row 2 of {path} (line 3) is not valid CSV: field larger than field "
                                 "limit (20)")

"""The bad-data table: every problem with a source's files is a SpecError (exit code 2) whose one-line message
names the data.* field and the file — found when the source is opened, or when the bad sample is read."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from polytrain.data.source import Data
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

Case = Callable[[Path], tuple[DataSpec, str]]  # tmp_path -> (spec, what the message must name besides the field)


def opener(name: str) -> Callable[[DataSpec, int], Data]:
    from polytrain.registry import source

    module, _, attr = source(name).target.partition(":")
    return getattr(__import__(module, fromlist=[attr]), attr)


def parquet(tmp: Path, name: str = "t.parquet", **columns: object) -> Path:
    columns = columns or {"a": np.arange(10.0), "label": np.arange(10) % 2}
    pq.write_table(pa.table(columns), tmp / name, row_group_size=4)
    return tmp / name


def pq_spec(path: Path | str, **fields: object) -> DataSpec:
    return DataSpec(**{"name": "parquet", "path": str(path), "features": ("a",), "label": "label", **fields})


def csv_spec(path: Path, **fields: object) -> DataSpec:
    return DataSpec(**{"name": "csv", "path": str(path), "features": ("a",), "label": "label", **fields})


def image_tree(tmp: Path, sizes: tuple[tuple[int, int], ...] = ((4, 4), (4, 4)), folders: int = 2) -> Path:
    for k, (h, w) in enumerate(sizes):
        (tmp / "tree" / f"class{k % folders}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (w, h)).save(tmp / "tree" / f"class{k % folders}" / f"img{k}.png")
    return tmp / "tree"


def tokens(tmp: Path, data: bytes) -> Path:
    (tmp / "t.bin").write_bytes(data)
    return tmp / "t.bin"


def factory_module(tmp: Path, body: str) -> str:
    name = f"bad_factory_{abs(hash(str(tmp))) % 10**8}"
    (tmp / f"{name}.py").write_text(body)
    sys.path.insert(0, str(tmp))
    return name


def _corrupt_image(tmp: Path) -> tuple[DataSpec, str]:
    root = image_tree(tmp)
    (root / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)
    return DataSpec(name="images", path=str(root)), "broken.png"


def _mixed_sizes(tmp: Path) -> tuple[DataSpec, str]:
    root = image_tree(tmp, ((4, 4), (4, 4), (4, 4), (6, 5)))
    return DataSpec(name="images", path=str(root)), "img3.png"


def _csv_val_inside_path(tmp: Path) -> tuple[DataSpec, str]:
    (tmp / "d" / "val").mkdir(parents=True)
    for name in ("d/train.csv", "d/val/held.csv"):
        (tmp / name).write_text("a,label\n1,0\n2,1\n")
    return csv_spec(tmp / "d", val_path=str(tmp / "d" / "val")), "held.csv"


def _images_val_inside_path(tmp: Path) -> tuple[DataSpec, str]:
    root = image_tree(tmp)
    for k in range(2):  # a validation tree with the same classes, inside the training tree
        (root / "val" / f"class{k}").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(root / "val" / f"class{k}" / f"held{k}.png")
    return DataSpec(name="images", path=str(root), val_path=str(root / "val")), "held"


def _parquet_images_val_inside_path(tmp: Path) -> tuple[DataSpec, str]:
    import io

    blobs = []
    for _ in range(4):
        buffer = io.BytesIO()
        Image.new("RGB", (4, 4)).save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    (tmp / "d").mkdir()
    for name in ("train.parquet", "held.parquet"):
        pq.write_table(pa.table({"image": pa.array(blobs, pa.binary()), "label": np.arange(4) % 2}), tmp / "d" / name)
    return DataSpec(name="parquet", path=str(tmp / "d"), val_path=str(tmp / "d" / "held.parquet"),
                    features=("image",), label="label"), "held.parquet"


def _csv(tmp: Path, text: str, **fields: object) -> tuple[DataSpec, str]:
    (tmp / "t.csv").write_text(text)
    return csv_spec(tmp / "t.csv", **fields), "t.csv"


def _npz(tmp: Path, x: np.ndarray, y: np.ndarray) -> tuple[DataSpec, str]:
    np.savez(tmp / "t.npz", x=x, y=y)
    return DataSpec(name="npz", path=str(tmp / "t.npz")), "t.npz"


def _dataset(tmp: Path, items: str) -> tuple[DataSpec, str]:
    m = factory_module(tmp, f"def make():\n    return {items}\n")
    return DataSpec(name="dataset", factory=m + ":make"), m


BIG = 2**40  # a stray label: inferred as the class count, a model of 10**12 outputs


CASES: dict[str, tuple[str, Case]] = {
    "parquet glob matches nothing": ("path", lambda t: (pq_spec(t / "nothing-*.parquet"), "nothing-*.parquet")),
    "parquet directory without parquet": ("path", lambda t: (pq_spec(t), str(t))),
    "parquet missing feature column": ("features", lambda t: (pq_spec(parquet(t), features=("a", "b")), "t.parquet")),
    "parquet missing label column": ("label", lambda t: (pq_spec(parquet(t), label="y"), "t.parquet")),
    "parquet not a parquet file": ("path", lambda t: ((t / "x.parquet").write_bytes(b"PAR1 garbage"),
                                                      pq_spec(t / "x.parquet"))[1:] + ("x.parquet",)),
    "parquet empty table": ("path", lambda t: (pq_spec(parquet(t, a=np.zeros(0), label=np.zeros(0, np.int64))),
                                               "t.parquet")),
    "parquet negative label": ("label", lambda t: (pq_spec(parquet(t, a=np.ones(5), label=np.array([0, 1, -1, 0, 1]))),
                                                   "t.parquet")),
    "parquet label >= classes": ("label", lambda t: (pq_spec(parquet(t, a=np.ones(3), label=np.array([0, 1, 2])),
                                                             classes=2), "t.parquet")),
    "parquet text features": ("features", lambda t: (pq_spec(parquet(t, a=["x", "y"], label=np.array([0, 1]))),
                                                     "t.parquet")),
    "parquet val file disagrees": ("val_path", lambda t: (pq_spec(parquet(t), val_path=str(parquet(
        t, "v.parquet", a=np.ones(3), label=np.array([0.5, 1.0, 2.0])))), "v.parquet")),
    "csv missing column": ("features", lambda t: ((t / "t.csv").write_text("b,label\n1,0\n"),
                                                  csv_spec(t / "t.csv"))[1:] + ("t.csv",)),
    "csv header only": ("path", lambda t: ((t / "t.csv").write_text("a,label\n"), csv_spec(t / "t.csv"))[1:] + ("t.csv",)),
    "csv empty file": ("features", lambda t: ((t / "t.csv").write_text(""), csv_spec(t / "t.csv"))[1:] + ("t.csv",)),
    "csv text in a feature": ("features", lambda t: ((t / "t.csv").write_text("a,label\n1,0\nabc,1\n"),
                                                     csv_spec(t / "t.csv"))[1:] + ("t.csv",)),
    "csv label >= classes": ("label", lambda t: ((t / "t.csv").write_text("a,label\n1,0\n2,5\n"),
                                                 csv_spec(t / "t.csv", classes=3))[1:] + ("t.csv",)),
    "csv quoted field never closes": ("path", lambda t: ((t / "t.csv").write_text('a,note,label\n1,"ok",0\n2,"open,1\n3,x,1\n'),
                                                         csv_spec(t / "t.csv"))[1:] + ("t.csv",)),
    "csv glob matches nothing": ("path", lambda t: (csv_spec(t / "*.csv"), "*.csv")),
    "csv val_path inside path": ("val_path", _csv_val_inside_path),
    "parquet glob matches val_path": ("val_path", lambda t: (pq_spec(t / "*.parquet", val_path=str(
        parquet(t, "v.parquet"))), "v.parquet")),
    "parquet images val_path inside path": ("val_path", _parquet_images_val_inside_path),
    "images val tree inside the training tree": ("val_path", _images_val_inside_path),
    "token file val_path is path": ("val_path", lambda t: (DataSpec(
        name="token_file", path=str(p := tokens(t, np.arange(40, dtype=np.uint16).tobytes())), val_path=str(p),
        seq_len=3), "t.bin")),
    # issue 26: non-finite values, stray huge labels
    "csv NaN in a feature": ("features", lambda t: _csv(t, "a,label\n1,0\nnan,1\n")),
    "csv value beyond float32 in a feature": ("features", lambda t: _csv(t, "a,label\n1e39,0\n2,1\n")),
    "csv Inf label": ("label", lambda t: _csv(t, "a,label\n1,0.5\n2,inf\n")),
    "csv huge label": ("label", lambda t: _csv(t, f"a,label\n1,0\n2,{BIG}\n")),
    "parquet NaN in a feature": ("features", lambda t: (pq_spec(parquet(t, a=np.array([1.0, np.nan, 2.0]),
                                                                        label=np.array([0, 1, 0]))), "t.parquet")),
    "parquet NaN in an array feature": ("features", lambda t: (pq_spec(parquet(
        t, a=pa.array([[1.0, 2.0], [3.0, np.inf]], pa.list_(pa.float64(), 2)), label=np.array([0, 1]))), "t.parquet")),
    "parquet Inf label": ("label", lambda t: (pq_spec(parquet(t, a=np.ones(3), label=np.array([0.5, -np.inf, 1.0]))),
                                              "t.parquet")),
    "parquet huge label": ("label", lambda t: (pq_spec(parquet(t, a=np.ones(3), label=np.array([0, 1, BIG]))),
                                               "t.parquet")),
    "npz NaN in x": ("path", lambda t: _npz(t, np.array([[0.0], [np.nan]]), np.array([0, 1]))),
    "npz huge label": ("path", lambda t: _npz(t, np.ones((3, 2)), np.array([0, 1, BIG]))),
    "npz negative label": ("path", lambda t: _npz(t, np.ones((3, 2)), np.array([0, -1, 1]))),
    "token ids beyond the inferred vocabulary": ("path", lambda t: (DataSpec(
        name="token_file", path=str(tokens(t, np.array([1, 2, 3, 1 << 21] * 4, dtype=np.uint32).tobytes())),
        dtype="uint32", seq_len=3), "t.bin")),
    "dataset NaN in x": ("features", lambda t: _dataset(t, "[([1.0], 0.5), ([float('nan')], 1.5)] * 3")),
    "dataset Inf target": ("label", lambda t: _dataset(t, "[([1.0], 0.5), ([2.0], float('inf'))] * 3")),
    "dataset huge label": ("label", lambda t: _dataset(t, f"[([1.0], 0), ([2.0], {BIG})] * 3")),
    "images corrupt file": ("path", _corrupt_image),
    "images mixed sizes without image_size": ("image_size", _mixed_sizes),
    "images no class folders": ("path", lambda t: (DataSpec(name="images", path=str(t)), str(t))),
    "images fewer classes than folders": ("classes", lambda t: (DataSpec(
        name="images", path=str(image_tree(t, ((4, 4),) * 3, folders=3)), classes=2), "tree")),
    "images mean for the wrong channels": ("mean", lambda t: (DataSpec(name="images", path=str(image_tree(t)),
                                                                       mean=(0.5, 0.5)), "3")),
    "token file odd size": ("dtype", lambda t: (DataSpec(name="token_file", path=str(tokens(t, b"\x01\x00\x02")),
                                                         seq_len=1), "t.bin")),
    "token file empty": ("path", lambda t: (DataSpec(name="token_file", path=str(tokens(t, b"")), seq_len=1), "t.bin")),
    "token file shorter than a window": ("seq_len", lambda t: (DataSpec(
        name="token_file", path=str(tokens(t, np.arange(5, dtype=np.uint16).tobytes())), seq_len=8), "t.bin")),
    "token ids >= vocab": ("vocab", lambda t: (DataSpec(
        name="token_file", path=str(tokens(t, np.arange(40, dtype=np.uint16).tobytes())), seq_len=3, vocab=30),
        "t.bin")),
    "factory cannot be imported": ("factory", lambda t: (DataSpec(name="dataset", factory="no_such_module:make"),
                                                         "no_such_module")),
    "factory is not a path": ("factory", lambda t: (DataSpec(name="dataset", factory="just_a_name"), "just_a_name")),
    "factory returns no dataset": ("factory", lambda t: (DataSpec(name="dataset", factory=(
        m := factory_module(t, "def make():\n    return iter(range(3))\n")) + ":make"), m)),
    "dataset label >= classes": ("label", lambda t: (DataSpec(name="dataset", classes=3, factory=(
        m := factory_module(t, "def make():\n    return [([1.0], i) for i in range(5)]\n")) + ":make"), m)),
    "dataset dict rows without columns": ("features", lambda t: (DataSpec(name="dataset", factory=(
        m := factory_module(t, "def make():\n    return [{'x': 1.0, 'y': 0}] * 4\n")) + ":make"), m)),
}


def read_everything(data: Data) -> None:
    for source in (data.train, data.val):
        order = np.arange(len(source))
        for start in range(0, len(order), 4):
            x, y = source.read(order[start:start + 4])
            if data.augment is not None:
                data.augment(x, y, [np.random.default_rng(i) for i in range(len(x))])


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_data_is_one_line_naming_field_and_file(case: str, tmp_path: Path) -> None:
    field, build = CASES[case]
    data_spec, names = build(tmp_path)
    with pytest.raises(SpecError) as caught:
        read_everything(opener(data_spec.name)(data_spec, 0))
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"data.{field}: "), message
    assert names in message, message

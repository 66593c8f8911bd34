"""data.name: parquet with a column of encoded images — HF ``datasets``' Image struct (bytes, path) or plain binary."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from specs import data_spec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

from polytrain.data.parquet_images import ParquetImageSource, open_parquet_data  # noqa: E402
from polytrain.data.prefetch import sample_rngs  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec.tables import AugmentSpec  # noqa: E402
from tests.data.test_images import H, W, ids, pixels  # noqa: E402

STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def encode(image: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image, "RGB").save(buffer, format=fmt)
    return buffer.getvalue()


def write(path: Path, samples: range, *, hf: bool = True, size: tuple[int, int] = (H, W), fmt: str = "PNG",
          group: int = 7) -> Path:
    """Rows ``samples``: the image spelling each id (see test_images.pixels), label id % 3."""
    blobs = [encode(pixels(i, 3, *size), fmt) for i in samples]
    images = pa.array([{"bytes": b, "path": f"{i}.png"} for b, i in zip(blobs, samples)], type=STRUCT) if hf \
        else pa.array(blobs, type=pa.binary())
    pq.write_table(pa.table({"image": images, "label": pa.array([i % 3 for i in samples])}), path, row_group_size=group)
    return path


spec = partial(data_spec, "parquet", features=("image",), label="label", val_fraction=0.0)


@pytest.mark.parametrize("hf", [True, False])
def test_images_read_back_row_by_row(tmp_path: Path, hf: bool) -> None:
    data = open_parquet_data(spec(write(tmp_path / "t.parquet", range(30), hf=hf)), seed=0)
    assert isinstance(data.train, ParquetImageSource)
    assert data.info.image_shape == (3, H, W) and data.info.input_shape == (3 * H * W,)
    assert (data.info.num_outputs, data.info.task) == (3, "classification")
    order = np.random.default_rng(0).permutation(30)
    x, y = data.train.read(order)
    assert x.dtype == np.float32 and x.shape == (30, 3 * H * W)
    np.testing.assert_array_equal(ids(x, y), order)
    np.testing.assert_array_equal(y, order % 3)
    expected = pixels(int(order[4]), 3).transpose(2, 0, 1).reshape(-1) / 255
    np.testing.assert_allclose(x[4], expected, rtol=1e-6)


def test_resize_normalise_augment_and_a_separate_val_file(tmp_path: Path) -> None:
    train = write(tmp_path / "train.parquet", range(20), size=(12, 10), fmt="JPEG")
    val = write(tmp_path / "val.parquet", range(20, 26), size=(12, 10), fmt="JPEG")
    data = open_parquet_data(spec(train, val_path=str(val), image_size=(6, 5), channels=1, mean=(0.5,), std=(0.5,),
                                  augment=AugmentSpec(horizontal_flip=True)), seed=0)
    assert data.info.image_shape == (1, 6, 5) and (len(data.train), len(data.val)) == (20, 6)
    assert data.augment is not None
    x, _ = data.val.read(np.arange(6))
    assert x.shape == (6, 30) and -1.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.1
    # the flip is applied to the decoded pixels, to the bytes of flipping the normalised batch
    rngs = sample_rngs(0, 0, 0, np.arange(20))
    got, _ = data.train.read(np.arange(20), draws=data.augment.draws(rngs))
    plain, y = data.train.read(np.arange(20))
    want, _ = data.augment(plain, y, sample_rngs(0, 0, 0, np.arange(20)))
    np.testing.assert_array_equal(got, want)
    assert 0 < sum(not np.array_equal(a, b) for a, b in zip(got, plain)) < 20


def test_exactly_once_across_ranks_and_micro_steps(tmp_path: Path, exactly_once) -> None:
    source = open_parquet_data(spec(write(tmp_path / "t.parquet", range(40))), seed=0).train
    exactly_once(source, ids, list(range(40)))


def test_bad_images_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    blobs = [encode(pixels(i, 3)) for i in range(6)]
    blobs[4] = b"\x89PNG broken"
    pq.write_table(pa.table({"image": pa.array(blobs), "label": pa.array([0, 1] * 3)}), path, row_group_size=4)
    source = open_parquet_data(spec(path), seed=0).train
    with pytest.raises(SpecError, match=rf"^data\.path: cannot decode image row 0 of row group 1 of {path}: "):
        source.read(np.array([1, 4]))
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"image": pa.array([encode(pixels(0, 3)), encode(pixels(1, 3, 4, 4))]),
                             "label": pa.array([0, 1])}), mixed)
    with pytest.raises(SpecError, match=r"^data\.image_size: images differ in size .* set data\.image_size"):
        open_parquet_data(spec(mixed), seed=0).train.read(np.array([0, 1]))
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"image": pa.array([1.0, 2.0]), "label": pa.array([0, 1])}), numbers)
    with pytest.raises(SpecError, match=r"^data\.image_size: for a Parquet column of encoded images; data\.features "
                                        rf"of {numbers} are numbers$"):
        open_parquet_data(spec(numbers, image_size=(4, 4)), seed=0)
    assert len(open_parquet_data(spec(numbers), seed=0).train) == 2  # numbers still read as numbers

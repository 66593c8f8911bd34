"""``data.name: parquet`` whose one feature column holds encoded images (PNG/JPEG bytes): what HF ``datasets``
writes for an ``Image`` feature (a struct of ``bytes`` and ``path``), or a plain binary column.

The row groups, their order and the label checks are those of `polytrain.data.parquet.ParquetSource`; what
a row group's cache entry holds is the encoded images (a few KiB a row), and a batch decodes only its own
rows with Pillow, in the reader threads: converted to ``data.channels``, resized to ``data.image_size`` (or
all the first image's size), scaled and normalised by ``data.mean``/``data.std`` and flattened (C, H, W) —
as ``data.name: images`` does, with the same seeded ``data.augment``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from polytrain.data.files import assemble, check_apart, expand, num_outputs, pair
from polytrain.data.image_decode import Decoder, ImageProblem
from polytrain.data.images import make_augment, normalisation
from polytrain.data.parquet import Block, ParquetSource, open_parquet
from polytrain.data.source import Data, DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec

#: the data.* fields that describe images: only for a column of encoded images
IMAGE_FIELDS = ("image_size", "channels", "mean", "std", "augment")


def holds_images(tp: pa.DataType) -> bool:
    """A binary column, or HF ``datasets``' image struct (``bytes`` and ``path``)."""
    if pa.types.is_binary(tp) or pa.types.is_large_binary(tp):
        return True
    return pa.types.is_struct(tp) and tp.get_field_index("bytes") >= 0


def _blobs(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.field("bytes") if pa.types.is_struct(array.type) else array


class ParquetImageSource(ParquetSource):
    """Rows of Parquet files whose feature column holds encoded images."""

    def __init__(self, files: list[Path], spec: DataSpec, field: str, size: tuple[int, int] | None = None) -> None:
        self.spec, self.size, self.decoder = spec, size, None
        assert spec.features is not None and spec.label is not None
        super().__init__(files, spec.features, spec.label, window=spec.shuffle_window, field=field)

    def _width(self, schema: pa.Schema, path: Path, f: int) -> int:
        tp = schema.field(self.features[0]).type
        if not holds_images(tp):
            raise SpecError(f"data.features: column {self.features[0]!r} in {path} has type {tp}, not encoded images "
                            "(binary, or HF's struct of bytes and path) like the first file's")
        self.array = False
        if self.decoder is None:
            self.decoder = self._make_decoder(f, path)
        return self.decoder.sample_floats

    def _make_decoder(self, f: int, path: Path) -> Decoder:
        spec = self.spec
        scale, offset = normalisation(spec)
        reference = None
        if spec.image_size is not None:
            height, width = spec.image_size
        elif self.size is not None:
            (height, width), reference = self.size, ("data.path's first image", *self.size)
        else:
            height, width = self._first_size(f, path)
            reference = (f"the first image of {path}", height, width)
        return Decoder([], "L" if spec.channels == 1 else "RGB", height, width, spec.image_size is not None,
                       scale.tolist(), offset.tolist(), reference, field=self.field,
                       crop_padding=spec.augment.crop_padding, horizontal_flip=spec.augment.horizontal_flip)

    def _first_size(self, f: int, path: Path) -> tuple[int, int]:
        for i in range(self._meta[f].num_row_groups):
            blobs = _blobs(self._read(f, i, [self.features[0]]).column(0))
            if len(blobs) and blobs[0].is_valid:
                try:
                    with Image.open(io.BytesIO(blobs[0].as_py())) as image:
                        return image.size[1], image.size[0]
                except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad image
                    raise SpecError(f"data.{self.field}: cannot decode image (row 0 of row group {i} of {path}): "
                                    f"{type(exc).__name__}: {exc}") from exc
        raise SpecError(f"data.{self.field}: {path} has no image to take data.image_size from; set data.image_size")

    def _decode(self, g: int) -> Block:
        """Row group ``g``'s encoded images (an object array of bytes) and labels."""
        f, i = self.groups[g]
        table = self._read(f, i, [self.features[0], self.label])
        images, labels = table.column(0), table.column(1)
        for column, name, field in ((images, self.features[0], "features"), (labels, self.label, "label")):
            self._no_nulls(column, name, field, f, i)
        blobs = np.empty(len(images), dtype=object)
        blobs[:] = _blobs(images).to_pylist()
        with np.errstate(over="ignore"):
            y = labels.to_numpy().astype(self.y_dtype, copy=False)
        self._finite(y, self.label, "label", f, i, 0)
        return blobs, y

    #: `read` takes the augmentation's draws and crops and flips the decoded pixels (`images.ImageAugment`)
    augments_while_decoding = True

    def read(self, indices: np.ndarray, draws: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        assert self.decoder is not None
        indices = np.asarray(indices, dtype=np.int64)
        groups = np.searchsorted(self.starts, indices, side="right") - 1
        d = self.decoder
        pixels = np.empty((len(indices), d.height, d.width, d.channels), dtype=np.uint8)
        y = np.empty(len(indices), dtype=self.y_dtype)
        unique, first = np.unique(groups, return_index=True)
        for g in unique[np.argsort(first)]:
            take = np.flatnonzero(groups == g)
            blobs, labels = self._cache.get(int(g), lambda g=int(g): self._decode(g))
            f, i = self.groups[g]
            for k in take:
                row = int(indices[k] - self.starts[g])
                try:
                    pixels[k] = d.decode(blobs[row], f"row {row} of row group {i} of {self.paths[f]}")
                except ImageProblem as problem:
                    raise SpecError(f"data.{problem.field}: {problem}") from problem
                y[k] = labels[row]
        return d.normalise(d.augment(pixels, draws)), y


def open_parquet_data(spec: DataSpec, seed: int) -> Data:
    """``data.name: parquet``: a column of encoded images when the first file's one feature column holds them,
    numbers otherwise (`polytrain.data.parquet.open_parquet`)."""
    assert spec.path is not None and spec.features is not None and spec.label is not None
    files = expand(spec.path, "path", (".parquet",))
    try:
        schema = pq.read_schema(files[0])
    except (OSError, pa.ArrowException) as exc:
        raise SpecError(f"data.path: {files[0]} is not a readable Parquet file: {exc}") from exc
    column = spec.features[0]
    if len(spec.features) != 1 or schema.get_field_index(column) < 0 or not holds_images(schema.field(column).type):
        default = DataSpec(name="parquet")
        for name in IMAGE_FIELDS:
            if getattr(spec, name) != getattr(default, name):
                raise SpecError(f"data.{name}: for a Parquet column of encoded images; data.features of "
                                f"{files[0]} are numbers")
        return open_parquet(spec, seed)
    train = ParquetImageSource(files, spec, "path")
    assert train.decoder is not None
    val = None
    if spec.val_path is not None:
        size = (train.decoder.height, train.decoder.width)
        val_files = expand(spec.val_path, "val_path", (".parquet",))
        check_apart(files, val_files)
        val = ParquetImageSource(val_files, spec, "val_path", size=size)
        if val.task != train.task:
            raise SpecError(f"data.val_path: {val.paths[0]} has {val.task} labels; data.path has {train.task}")
    high = 0
    if train.task == "classification":
        for source in (train, val) if val is not None else (train,):
            high = max(high, source.label_range(spec.classes)[1])
    shape = (train.decoder.channels, train.decoder.height, train.decoder.width)
    info = DatasetInfo(input_shape=(int(np.prod(shape)),), num_outputs=num_outputs(train.task, spec.classes, high),
                       task=train.task, image_shape=shape)
    guarantee = (f"every row once per epoch; row groups permuted, rows shuffled within windows of "
                 f"{spec.shuffle_window} row groups (seed, epoch)")
    augment = make_augment(shape, spec.augment, train.decoder.offset)
    return assemble(*pair(train, val, spec.val_fraction, seed), info, guarantee, augment=augment)

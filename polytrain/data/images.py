"""``data.name: images`` — a class-per-folder tree of image files (PNG, JPEG, WebP, BMP, GIF, TIFF, ...),
decoded with Pillow.

The convention of torchvision's ``ImageFolder`` and Keras' ``image_dataset_from_directory``: the classes
are the sorted names of ``data.path``'s sub-directories, their label the position in that list; the
images are every file under a class folder whose suffix is one of `FORMATS` this Pillow opens, sorted.
A validation tree (``data.val_path``) uses the training tree's class names. Each image is converted to
``data.channels`` (``L`` or ``RGB``), resized to ``data.image_size`` when given (else every image must have
the first one's size: checked as each is read), scaled to [0, 1], normalised by ``data.mean``/``data.std``
and flattened in (C, H, W) order. Map-style: the epoch's order is a full shuffle.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from polytrain.data.decode_pool import DecodePool, DecoderGone
from polytrain.data.files import assemble, check_apart, nested, pair
from polytrain.data.image_decode import Decoder, ImageProblem, crops
from polytrain.data.plan import shuffled
from polytrain.data.source import Data, DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import AugmentSpec, DataSpec

#: the raster formats read, each where this Pillow can open it (WebP, AVIF, JPEG 2000 depend on its build); other
#: files under the class folders are not images to this source (named in the error when a tree holds no image)
FORMATS = (".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".dib", ".gif", ".tif", ".tiff", ".ppm", ".pgm",
           ".pbm", ".pnm", ".tga", ".avif", ".qoi", ".jp2", ".j2k")


@functools.cache
def image_suffixes() -> tuple[str, ...]:
    """The suffixes of `FORMATS` this Pillow opens (some of its registered ones only identify a file, or are
    containers of other data: HDF5, GRIB, MPEG)."""
    Image.init()
    known = Image.registered_extensions()
    return tuple(s for s in FORMATS if known.get(s) in Image.OPEN)


def _class_folders(root: Path, field: str) -> list[str]:
    if not root.is_dir():
        raise SpecError(f"data.{field}: {root} is not a directory (images: one sub-directory of images per class)")
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not names:
        raise SpecError(f"data.{field}: {root} has no class sub-directories (images: one sub-directory per class)")
    return names


def normalisation(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per channel (scale, offset) with ``x = pixel * scale + offset`` = ``(pixel / 255 - mean) / std``."""
    values = {}
    for name, default in (("mean", 0.0), ("std", 1.0)):
        given = getattr(spec, name)
        given = (default,) if given is None else given
        if len(given) not in (1, spec.channels):
            raise SpecError(f"data.{name}: {len(given)} values for data.channels {spec.channels} (give 1 or {spec.channels})")
        values[name] = np.broadcast_to(np.asarray(given, dtype=np.float64), (spec.channels,))
    if (values["std"] <= 0).any():
        raise SpecError(f"data.std: must be positive, got {list(spec.std or ())}")
    scale = 1.0 / (255.0 * values["std"])
    return scale.astype(np.float32), (-values["mean"] / values["std"]).astype(np.float32)


class ImageFolderSource:
    """The images of one class-per-folder tree."""

    def __init__(self, root: Path, field: str, spec: DataSpec, classes: list[str] | None = None,
                 reference: tuple[Path, tuple[int, int]] | None = None) -> None:
        self.root, self.field, self.channels = root, field, spec.channels
        folders = _class_folders(root, field)
        self.classes = classes if classes is not None else folders
        unknown = sorted(set(folders) - set(self.classes))
        if unknown:
            raise SpecError(f"data.{field}: {root} has class folders {unknown} that data.path's tree lacks "
                            f"(classes: {', '.join(self.classes)})")
        files: list[Path] = []
        labels: list[int] = []
        suffixes, skipped = image_suffixes(), collections.Counter[str]()
        for name in folders:
            found = []
            for p in (root / name).rglob("*"):
                if p.is_file():
                    if p.suffix.lower() in suffixes:
                        found.append(p)
                    else:
                        skipped[p.suffix.lower() or "no suffix"] += 1
            files += sorted(found)
            labels += [self.classes.index(name)] * len(found)
        if not files:
            others = f" (only {', '.join(f'{n} {s}' for s, n in skipped.most_common(5))})" if skipped else ""
            raise SpecError(f"data.{field}: no image files under the class folders of {root}{others}; read: "
                            f"{' '.join(suffixes)}")
        self.files, self.labels = files, np.asarray(labels, dtype=np.int64)
        self.mode = "L" if spec.channels == 1 else "RGB"
        self.scale, self.offset = normalisation(spec)
        if spec.image_size is not None:
            self.height, self.width = spec.image_size
            self.reference: tuple[Path, tuple[int, int]] | None = None
        else:
            self.reference = reference or (files[0], self._size(files[0]))
            self.width, self.height = self.reference[1]
        ref = None if self.reference is None else (str(self.reference[0]), self.height, self.width)
        self._config: dict[str, Any] = {
            "files": [str(f) for f in files], "mode": self.mode, "height": self.height, "width": self.width,
            "resize": spec.image_size is not None, "scale": self.scale.tolist(), "offset": self.offset.tolist(),
            "reference": ref, "field": field, "crop_padding": spec.augment.crop_padding,
            "horizontal_flip": spec.augment.horizontal_flip}
        self.decoder = Decoder(**self._config)
        #: decoding processes (data.worker_kind), started at the first read; 0: decode in the reading thread
        self.processes = spec.workers if worker_kind(spec) == "processes" else 0
        self._pool: DecodePool | None = None
        self._pool_lock = threading.Lock()

    def _size(self, path: Path) -> tuple[int, int]:
        try:
            with Image.open(path) as image:
                return image.size
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise SpecError(f"data.{self.field}: cannot read image {path}: {type(exc).__name__}: {exc}") from exc

    def _decode(self, indices: np.ndarray, draws: np.ndarray | None) -> np.ndarray:
        if not self.processes:
            return self.decoder.batch(indices, draws)
        with self._pool_lock:
            if self._pool is None:
                self._pool = DecodePool(self._config, self.processes)
        try:
            return self._pool.read(indices, draws)
        except DecoderGone as exc:
            raise SpecError(f"data.worker_kind: {exc} while reading {self.root} (data.worker_kind: threads "
                            "decodes in the training process)") from exc

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pool", "_pool_lock")}  # a copy starts its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pool=None, _pool_lock=threading.Lock())

    def close(self) -> None:
        """Stop the decoding processes, if any were started (they also stop when this process ends)."""
        if self._pool is not None:
            self._pool.close()

    def __len__(self) -> int:
        return len(self.files)

    #: `read` takes the augmentation's draws and crops and flips the decoded pixels (`ImageAugment`)
    augments_while_decoding = True

    def read(self, indices: np.ndarray, draws: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        try:
            x = self._decode(indices, draws)
        except ImageProblem as problem:
            raise SpecError(f"data.{problem.field}: {problem}") from problem
        return x, self.labels[indices]

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self), seed, epoch)


def worker_kind(spec: DataSpec) -> str:
    """``data.worker_kind`` resolved: ``auto`` decodes in processes whenever there are reader workers."""
    if spec.worker_kind == "auto":
        return "processes" if spec.workers > 0 else "threads"
    return spec.worker_kind


class ImageAugment:
    """Seeded random crop (of the image padded by ``crop_padding`` with black) and horizontal flip of training
    images. Each sample's crop and flip come from its own Generator (``rngs[i]``, seeded by seed, epoch and the
    sample's index): three uniform draws, crop row, crop column and flip (`draws`).

    The image sources apply the draws to the decoded uint8 pixels, in their decoding workers
    (``read(indices, draws)``, `image_decode.augment_pixels`); called as ``(x, y, rngs)`` it does the same to a
    batch already normalised to flat (C, H, W) float32 rows, padding with ``fill`` (the normalised black of each
    channel), to the same bytes."""

    def __init__(self, shape: tuple[int, int, int], options: AugmentSpec, fill: np.ndarray) -> None:
        self.shape, self.padding, self.flip, self.fill = shape, options.crop_padding, options.horizontal_flip, fill

    @staticmethod
    def draws(rngs: Sequence[np.random.Generator]) -> np.ndarray:
        """(n, 3) uniform draws, three from each sample's Generator."""
        return np.array([rng.random(3) for rng in rngs]).reshape(len(rngs), 3)

    def __call__(self, x: np.ndarray, y: np.ndarray,
                 rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        n, (c, h, w) = len(x), self.shape
        if len(rngs) != n:
            raise ValueError(f"augment: {len(rngs)} generators for {n} samples")
        dy, dx, flips = crops(self.draws(rngs), self.padding)
        images, p = x.reshape(n, c, h, w), self.padding
        if p:
            padded = np.empty((n, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
            padded[:] = self.fill[None, :, None, None]
            padded[:, :, p:p + h, p:p + w] = images
            windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))
            images = windows[np.arange(n), :, dy, dx]  # (n, c, h, w): each image's own window
        if self.flip:
            images = np.where(flips[:, None, None, None], images[..., ::-1], images)
        return np.ascontiguousarray(images, dtype=x.dtype).reshape(n, c * h * w), y


def make_augment(shape: tuple[int, int, int], options: AugmentSpec, fill: np.ndarray) -> ImageAugment | None:
    """The training batches' `ImageAugment` for ``data.augment`` (None when it asks for nothing)."""
    return ImageAugment(shape, options, fill) if options.crop_padding or options.horizontal_flip else None


def open_images(spec: DataSpec, seed: int) -> Data:
    """``data.path``: the root of the class folders (``data.val_path``: the validation tree)."""
    assert spec.path is not None
    train = ImageFolderSource(Path(spec.path), "path", spec)
    val = None
    if spec.val_path is not None:
        val = ImageFolderSource(Path(spec.val_path), "val_path", spec, classes=train.classes, reference=train.reference)
        if nested(train.root, val.root):  # else no file can be both (listing a big tree's real paths is not free)
            check_apart(train.files, val.files)
    classes = len(train.classes)
    if spec.classes is not None and spec.classes < classes:
        raise SpecError(f"data.classes: {spec.classes}, but {spec.path} has {classes} class folders "
                        f"(labels 0..{classes - 1})")
    if spec.classes is None and classes < 2:
        raise SpecError(f"data.path: {spec.path} has {classes} class folder; classification needs 2 or more")
    shape = (spec.channels, train.height, train.width)
    info = DatasetInfo(input_shape=(int(np.prod(shape)),), num_outputs=spec.classes or classes,
                       task="classification", image_shape=shape)
    augment = make_augment(shape, spec.augment, train.offset)
    return assemble(*pair(train, val, spec.val_fraction, seed), info, "every image once per epoch, fully shuffled",
                    augment=augment)

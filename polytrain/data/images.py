"""``data.name: images`` — a class-per-folder tree of PNG/JPEG files, decoded with Pillow.

The convention of torchvision's ``ImageFolder`` and Keras' ``image_dataset_from_directory``: the classes
are the sorted names of ``data.path``'s sub-directories, their label the position in that list; the
images are every ``*.png``/``*.jpg``/``*.jpeg`` under a class folder, sorted. A validation tree
(``data.val_path``) uses the training tree's class names. Each image is converted to ``data.channels``
(``L`` or ``RGB``), resized to ``data.image_size`` when given (else every image must have the first
one's size: checked as each is read), scaled to [0, 1], normalised by ``data.mean``/``data.std`` and
flattened in (C, H, W) order. Map-style: the epoch's order is a full shuffle.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from polytrain.data.files import assemble, pair
from polytrain.data.plan import shuffled
from polytrain.data.source import Data
from polytrain.errors import SpecError
from polytrain.protocols import DatasetInfo
from polytrain.spec import AugmentSpec, DataSpec

SUFFIXES = (".png", ".jpg", ".jpeg")
_FORMATS = {".png": ("PNG",), ".jpg": ("JPEG",), ".jpeg": ("JPEG",)}  # skip probing every other format
Augment = Callable[[np.ndarray, np.ndarray, np.random.Generator], tuple[np.ndarray, np.ndarray]]


def _open(path: Path) -> Image.Image:
    """Pillow's open of the file's bytes, read in one call (Pillow's own reads of a file are many small ones,
    each holding the GIL), trying the format the suffix names first (a PNG named .jpg still opens)."""
    data = io.BytesIO(path.read_bytes())
    try:
        return Image.open(data, formats=_FORMATS.get(path.suffix.lower()))
    except UnidentifiedImageError:
        return Image.open(data)


def _class_folders(root: Path, field: str) -> list[str]:
    if not root.is_dir():
        raise SpecError(f"data.{field}: {root} is not a directory (images: one sub-directory of images per class)")
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not names:
        raise SpecError(f"data.{field}: {root} has no class sub-directories (images: one sub-directory per class)")
    return names


def _normalisation(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
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
        for name in folders:
            found = sorted(p for p in (root / name).rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
            files += found
            labels += [self.classes.index(name)] * len(found)
        if not files:
            raise SpecError(f"data.{field}: no {'/'.join('*' + s for s in SUFFIXES)} files under the class folders "
                            f"of {root}")
        self.files, self.labels = files, np.asarray(labels, dtype=np.int64)
        self.mode = "L" if spec.channels == 1 else "RGB"
        self.scale, self.offset = _normalisation(spec)
        self.resize = spec.image_size is not None
        if spec.image_size is not None:
            self.height, self.width = spec.image_size
            self.reference: tuple[Path, tuple[int, int]] | None = None
        else:
            self.reference = reference or (files[0], self._size(files[0]))
            self.width, self.height = self.reference[1]

    def _size(self, path: Path) -> tuple[int, int]:
        try:
            with Image.open(path) as image:
                return image.size
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise SpecError(f"data.{self.field}: cannot read image {path}: {type(exc).__name__}: {exc}") from exc

    def _pixels(self, i: int) -> np.ndarray:
        """Image ``i`` as uint8 (H, W, C)."""
        path = self.files[i]
        try:
            with _open(path) as image:
                if self.reference is not None and image.size != self.reference[1]:
                    (rw, rh), (w, h) = self.reference[1], image.size
                    raise SpecError(f"data.image_size: images differ in size ({self.reference[0]} is {rh}x{rw}, "
                                    f"{path} is {h}x{w}, height x width); set data.image_size: [height, width]")
                if image.mode != self.mode:  # convert() copies even when the mode is already right
                    image = image.convert(self.mode)
                if self.resize and image.size != (self.width, self.height):
                    image = image.resize((self.width, self.height), Image.Resampling.BILINEAR)
                pixels = np.asarray(image)
        except SpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a corrupt file
            raise SpecError(f"data.{self.field}: cannot decode image {path}: {type(exc).__name__}: {exc}") from exc
        return pixels.reshape(self.height, self.width, self.channels)

    def __len__(self) -> int:
        return len(self.files)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        pixels = np.empty((len(indices), self.height, self.width, self.channels), dtype=np.uint8)
        for k, i in enumerate(indices):
            pixels[k] = self._pixels(int(i))
        x = np.empty((len(indices), self.channels, self.height, self.width), dtype=np.float32)
        for c in range(self.channels):
            np.multiply(pixels[..., c], self.scale[c], out=x[:, c], dtype=np.float32)
            x[:, c] += self.offset[c]
        return x.reshape(len(indices), -1), self.labels[indices]

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self), seed, epoch)


def make_augment(shape: tuple[int, int, int], options: AugmentSpec, fill: np.ndarray) -> Augment | None:
    """Seeded random crop (pad by ``crop_padding`` with ``fill``, the normalised black of each channel, and
    crop back) and horizontal flip, over a whole batch of flat (C, H, W) images at once."""
    c, h, w = shape
    p = options.crop_padding
    if not p and not options.horizontal_flip:
        return None

    def augment(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n = len(x)
        images = x.reshape(n, c, h, w)
        if p:
            padded = np.empty((n, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
            padded[:] = fill[None, :, None, None]
            padded[:, :, p:p + h, p:p + w] = images
            dy, dx = rng.integers(0, 2 * p + 1, size=(2, n))
            windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))
            images = windows[np.arange(n), :, dy, dx]  # (n, c, h, w): each image's own window
        if options.horizontal_flip:
            flip = rng.random(n) < 0.5
            images = np.where(flip[:, None, None, None], images[..., ::-1], images)
        return np.ascontiguousarray(images, dtype=x.dtype).reshape(n, -1), y

    return augment


def open_images(spec: DataSpec, seed: int) -> Data:
    """``data.path``: the root of the class folders (``data.val_path``: the validation tree)."""
    assert spec.path is not None
    train = ImageFolderSource(Path(spec.path), "path", spec)
    val = None
    if spec.val_path is not None:
        val = ImageFolderSource(Path(spec.val_path), "val_path", spec, classes=train.classes, reference=train.reference)
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

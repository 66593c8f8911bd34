"""``data.name: dataset`` — a map-style dataset of the user's own code, made by ``data.factory``.

``package.module:function`` is called with no arguments and returns anything with ``__len__`` and
``__getitem__``: items are ``(x, y)`` (numpy arrays, numbers, or tensors: anything with ``.numpy()``, so a
torch ``Dataset`` returning tensors works without polytrain importing torch), or dict rows (an HF
``datasets.Dataset``: ``data.features`` name the input columns, ``data.label`` the target). A batch is
the items stacked; a dataset with ``__getitems__`` (HF ``datasets``, the torch convention) is asked for
the whole batch at once. Items are read from the data worker threads, so ``__getitem__`` must be safe to
call from several threads (reading files and numpy are; a shared open file handle is not).

The task follows the first item: an integer scalar y is a class label (``data.classes``, else the
dataset's ``classes``, its ``targets``, an HF ``ClassLabel``, or a scan of the labels), a float one a
regression target, integer sequences x and y are next-token data. An x of 3 dimensions is an image in
(C, H, W) order: it is flattened and ``image_shape`` set, as ``data.name: images`` does; a Pillow image (what
an HF ``Image`` column holds) becomes such an x, scaled to [0, 1]. The factory may return
``{"train": ..., "validation": ...}`` (an HF ``DatasetDict``) to name its own validation split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polytrain.data.files import assemble, check_inferred, first_nonfinite, num_outputs
from polytrain.data.plan import shuffled
from polytrain.data.source import Data, DatasetInfo, split
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec
from polytrain.spec.user_code import call_user, load_callable


def as_numpy(value: Any) -> np.ndarray:
    """A tensor (torch: ``.detach().cpu().numpy()``; TensorFlow: ``.numpy()``), number or list as numpy; a
    Pillow image (an HF ``Image`` column) as float32 (C, H, W) in [0, 1], as torchvision's ``ToTensor`` gives."""
    if callable(getattr(value, "getbands", None)) and hasattr(value, "size"):
        pixels = np.asarray(value)
        pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return pixels.astype(np.float32) * np.float32(1 / 255)
    if not isinstance(value, np.ndarray):
        for name in ("detach", "cpu", "numpy"):
            method = getattr(value, name, None)
            if callable(method):
                value = method()
    return np.asarray(value)


class UserSource:
    """The user's map-style dataset as a `polytrain.data.source.Source`.

    ``where`` is what messages name: ``data.factory`` (then ``name`` is the factory's import path, and a
    problem with the labels or columns names ``data.label``/``data.features``), or ``train_data``/``val_data``
    for a dataset handed to `polytrain.fit`.
    """

    def __init__(self, dataset: Any, where: str, features: tuple[str, ...] | None, label: str | None,
                 name: str | None = None) -> None:
        self.dataset, self.where, self.name, self.features, self.label = dataset, where, name, features, label
        x, y = self.item(0)
        self.sample_shape = x.shape
        if y.dtype.kind in "iub" and x.dtype.kind in "iu" and y.ndim == 1 and x.shape == y.shape:
            self.task = "next_token"
        elif y.dtype.kind in "iub" and y.ndim == 0:
            self.task = "classification"
        elif y.dtype.kind == "f" and y.size == 1:
            self.task = "regression"
        else:
            raise SpecError(f"{self.say()}item 0's y has dtype {y.dtype} and shape {y.shape}; expected an integer "
                            "class, a float target, or integer token sequences matching x")
        self.x_dtype = np.int64 if self.task == "next_token" else np.float32
        self.y_dtype = np.float32 if self.task == "regression" else np.int64
        self.classes: int | None = None

    def say(self, field: str | None = None) -> str:
        """The start of a message: the field (``data.label`` ...) or ``where``, then the factory's path."""
        head = f"data.{field}" if field and self.where.startswith("data.") else self.where
        return f"{head}: {self.name}: " if self.name else f"{head}: "

    def item(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._pair(self.dataset[i], i)

    def _pair(self, raw: Any, i: int) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(raw, Mapping):
            return self._row(raw, i)
        if isinstance(raw, Sequence) and len(raw) == 2:
            return as_numpy(raw[0]), as_numpy(raw[1])
        raise SpecError(f"{self.say()}item {i} is a {type(raw).__name__}, not an (x, y) pair or a dict row")

    def _row(self, row: Mapping[str, Any], i: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.features or not self.label:
            raise SpecError(f"{self.say('features')}items are dict rows (columns: {', '.join(map(str, row))}); "
                            "set data.features and data.label to the columns to use")
        for column, field in [(c, "features") for c in self.features] + [(self.label, "label")]:
            if column not in row:
                raise SpecError(f"{self.say(field)}no column {column!r} in its rows (columns: {', '.join(map(str, row))})")
        values = [as_numpy(row[c]) for c in self.features]
        x = values[0] if len(values) == 1 else np.stack(values)
        return x, as_numpy(row[self.label])

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = [int(i) for i in indices]
        many = getattr(self.dataset, "__getitems__", None)
        raws = many(keys) if callable(many) and keys else [self.dataset[i] for i in keys]
        pairs = [self._pair(raw, i) for raw, i in zip(raws, keys)]
        n = len(keys)
        x = np.empty((n, int(np.prod(self.sample_shape))) if self.flatten else (n, *self.sample_shape), self.x_dtype)
        y = np.empty((n, *self.sample_shape) if self.task == "next_token" else (n,), self.y_dtype)
        for k, (xi, yi) in enumerate(pairs):
            if xi.shape != self.sample_shape:
                raise SpecError(f"{self.say()}item {keys[k]} has x of shape {xi.shape}, item 0 {self.sample_shape}; "
                                "every item's x must have one shape")
            with np.errstate(over="ignore", invalid="ignore"):  # beyond float32: Inf, refused below
                x[k] = xi.reshape(x.shape[1:])
                y[k] = yi.reshape(y.shape[1:])
        for values, field in ((x, "features"), (y, "label")):
            bad = first_nonfinite(values)
            if bad is not None:
                raise SpecError(f"{self.say(field)}item {keys[bad]} has NaN or Inf in its {'x' if field == 'features' else 'y'} "
                                "(or a value float32 cannot hold); values must be finite numbers")
        if self.classes is not None and n and (y.min() < 0 or y.max() >= self.classes):
            bad = ((y < 0) | (y >= self.classes)).reshape(n, -1)
            k = int(np.argmax(bad.any(axis=1)))
            value = y.reshape(n, -1)[k][bad[k]][0]
            raise SpecError(f"{self.say('label')}item {keys[k]} has label {value}, not in 0..{self.classes - 1}")
        return x, y

    @property
    def flatten(self) -> bool:
        return self.task != "next_token" and len(self.sample_shape) != 1

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self), seed, epoch)

    def largest_label(self) -> int:
        """The number of classes the dataset says it has (minus one), or its largest label."""
        data = self.dataset
        named = getattr(data, "classes", None)
        if isinstance(named, Sequence) and not isinstance(named, str) and len(named) > 1:
            return len(named) - 1
        feature = getattr(data, "features", None)
        if self.label and isinstance(feature, Mapping) and hasattr(feature.get(self.label), "num_classes"):
            return int(feature[self.label].num_classes) - 1
        targets = getattr(data, "targets", None)
        if targets is None and self.label and self.label in (getattr(data, "column_names", None) or ()):
            targets = data[self.label]  # an HF dataset's label column, without decoding the other columns
        if targets is not None:
            labels = as_numpy(targets)
        else:
            labels = np.concatenate([self.read(np.arange(i, min(i + 1024, len(self))))[1].ravel()
                                     for i in range(0, len(self), 1024)])
        return int(labels.max())


def dataset_source(dataset: Any, where: str, spec: DataSpec, name: str | None = None) -> tuple[UserSource, DatasetInfo]:
    """A map-style dataset as a source and what it holds; ``where`` (and ``name``) as `UserSource` takes them."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise SpecError(f"{where}: {name + ' returned ' if name else ''}a {type(dataset).__name__}, not a map-style "
                        "dataset (needs __len__ and __getitem__; an iterable-only one cannot be shuffled exactly once)")
    if len(dataset) == 0:
        raise SpecError(f"{where}: {name + ' returned ' if name else ''}an empty dataset")
    source = UserSource(dataset, where, spec.features, spec.label, name)
    shape = source.sample_shape
    classes = None
    if source.task != "regression":
        largest = source.largest_label() if spec.classes is None else 0
        if spec.classes is None:
            check_inferred(largest, source.say("label")[:-2])
        classes = num_outputs("classification", spec.classes, largest)
    source.classes = classes
    image_shape = tuple(int(d) for d in shape) if len(shape) == 3 and source.task != "next_token" else None
    input_shape = (int(np.prod(shape)),) if source.flatten else tuple(int(d) for d in shape)
    info = DatasetInfo(input_shape=input_shape, num_outputs=classes or 1, task=source.task,
                       image_shape=image_shape)  # type: ignore[arg-type]
    return source, info


#: the names a factory's ``{"train": ..., <name>: ...}`` may give its validation split (HF ``DatasetDict`` keys)
VAL_SPLITS = ("validation", "val", "test")


def _splits(result: Any, name: str) -> tuple[Any, Any, str]:
    """(train, validation or None, the validation key) of what the factory returned."""
    if not isinstance(result, Mapping):
        return result, None, ""
    keys = ", ".join(map(repr, result)) or "none"
    if "train" not in result:
        raise SpecError(f"data.factory: {name} returned a mapping without a 'train' entry (keys: {keys}); return "
                        f"a dataset, or {{'train': ..., 'validation': ...}}")
    key = next((k for k in VAL_SPLITS if k in result), "")
    return result["train"], (result[key] if key else None), key


def open_user_dataset(spec: DataSpec, seed: int) -> Data:
    """Call ``data.factory``; a mapping it returns (an HF ``DatasetDict``, or ``{"train": ..., "validation": ...}``)
    names the training and validation datasets (the first of `VAL_SPLITS` present), else ``data.val_fraction``
    splits the one dataset."""
    assert spec.factory is not None
    factory = load_callable(spec.factory, "data.factory")
    dataset = call_user("data.factory", spec.factory, factory)
    train, val, key = _splits(dataset, spec.factory)
    source, info = dataset_source(train, "data.factory", spec, name=spec.factory)
    if val is None:
        return assemble(*split(source, spec.val_fraction, seed), info, "every item once per epoch, fully shuffled")
    named = f"{spec.factory}[{key!r}]"
    val_source, val_info = dataset_source(val, "data.factory", spec, name=named)
    if (val_info.input_shape, val_info.task) != (info.input_shape, info.task):
        raise SpecError(f"data.factory: {named} holds samples of shape {val_info.input_shape} ({val_info.task}), "
                        f"the 'train' split {info.input_shape} ({info.task})")
    val_source.classes = source.classes
    return assemble(source, val_source, info, "every item once per epoch, fully shuffled")

"""The built-in in-memory datasets (``digits``, ``synthetic``, ``npz``, ``tokens``) as numpy arrays.

Small by construction (bundled with scikit-learn, generated, or one ``.npz``); file-backed
sources stream instead (see `polytrain.data.sources`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polytrain.data.files import check_label_range, finite_or_refuse
from polytrain.data.plan import split_indices
from polytrain.data.source import DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec, TokenSpec


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    info: DatasetInfo


def _digits() -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """scikit-learn's bundled handwritten digits (no download), read from its file as ``load_digits`` reads it:
    importing ``sklearn.datasets`` costs every rank ~1.4 s of start-up (scipy.stats) for 1797 rows."""
    import importlib.util

    found = importlib.util.find_spec("sklearn")
    folders = list(found.submodule_search_locations or []) if found is not None else []
    table = next((p for p in (Path(d) / "datasets" / "data" / "digits.csv.gz" for d in folders) if p.is_file()), None)
    if table is None:
        from sklearn.datasets import load_digits  # raises the usual ImportError where scikit-learn is missing

        bunch = load_digits()
        data, target = bunch.data, bunch.target
    else:
        rows = np.loadtxt(table, delimiter=",")
        data, target = rows[:, :-1], rows[:, -1]
    return (data / 16.0).astype(np.float32), target.astype(np.int64), (1, 8, 8)


def _synthetic(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    s = spec.synthetic
    rng = np.random.default_rng(s.seed)
    x = rng.standard_normal((s.samples, s.features)).astype(np.float32)
    if s.task == "regression":
        w = rng.standard_normal((s.features,)).astype(np.float32)
        y = x @ w / math.sqrt(s.features) + s.noise * rng.standard_normal(s.samples).astype(np.float32)
        return x, y.astype(np.float32)
    centers = rng.standard_normal((s.classes, s.features)).astype(np.float32) * 2.0
    y = rng.integers(0, s.classes, size=s.samples)
    x = x * (1.0 + s.noise) + centers[y]
    return x.astype(np.float32), y.astype(np.int64)


def _npz(path: str, classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SpecError(f"data.path: {path} is not a readable .npz file: {' '.join(str(exc).split())}") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy: one array, no x/y names
        raise SpecError(f"data.path: {path} is a single .npy array; data.name npz needs an .npz archive holding "
                        f"arrays named 'x' and 'y' (np.savez(path, x=..., y=...))")
    with loaded as arrays:
        if "x" not in arrays or "y" not in arrays:
            raise SpecError(f"data.path: {path} must hold arrays named 'x' and 'y' (found: {', '.join(arrays)})")
        try:
            x, y = arrays["x"], arrays["y"]
        except (OSError, ValueError) as exc:
            raise SpecError(f"data.path: {path} is not a readable .npz file: {' '.join(str(exc).split())}") from exc
    if len(x) != len(y) or len(x) == 0:
        raise SpecError(f"data.path: x and y must have the same, non-zero length (x: {len(x)}, y: {len(y)})")
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32: Inf, refused below
        x = x.astype(np.float32)
        y = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)
    finite_or_refuse(x, f"data.path: {path}: x")
    finite_or_refuse(y, f"data.path: {path}: y")
    if y.dtype == np.int64:
        check_label_range(int(y.min()), int(y.max()), classes, f"{path}: y", field="data.path")
    return x, y


def token_corpus(spec: TokenSpec) -> np.ndarray:
    """``samples`` sequences of ``seq_len + 1`` tokens from a seeded order-2 rule.

    A random table gives each pair of tokens its successor; with probability ``noise`` a
    token is drawn uniformly instead. Predicting the next token needs the two before it
    (so the model must attend), and the best reachable next-token accuracy is about
    ``1 - noise`` after the first two positions. Deterministic in ``seed``; no download.
    """
    rng = np.random.default_rng([spec.seed, spec.vocab, spec.seq_len])
    rule = rng.integers(0, spec.vocab, size=(spec.vocab, spec.vocab))
    seq = np.empty((spec.samples, spec.seq_len + 1), dtype=np.int64)
    seq[:, :2] = rng.integers(0, spec.vocab, size=(spec.samples, 2))
    for t in range(2, spec.seq_len + 1):
        ruled = rule[seq[:, t - 2], seq[:, t - 1]]
        random = rng.integers(0, spec.vocab, size=spec.samples)
        seq[:, t] = np.where(rng.random(spec.samples) < spec.noise, random, ruled)
    return seq


def _tokens(spec: DataSpec, seed: int) -> Dataset:
    """Next-token prediction: x is a sequence, y the same sequence shifted by one token."""
    seq = token_corpus(spec.tokens)
    x, y = seq[:, :-1], seq[:, 1:]
    train, val = split_indices(len(seq), spec.val_fraction, seed)
    info = DatasetInfo(input_shape=(spec.tokens.seq_len,), num_outputs=spec.tokens.vocab, task="next_token")
    return Dataset(x[train], y[train], x[val], y[val], info)


def load_dataset(spec: DataSpec, seed: int) -> Dataset:
    """Load and split ``spec``'s data; the split depends only on ``seed``."""
    if spec.name == "tokens":
        return _tokens(spec, seed)
    image_shape = None
    if spec.name == "digits":
        x, y, image_shape = _digits()
    elif spec.name == "synthetic":
        x, y = _synthetic(spec)
    else:
        x, y = _npz(spec.path or "", spec.classes)
        if x.ndim == 4:
            image_shape = tuple(x.shape[1:])
            x = x.reshape(len(x), -1)
    regression = y.dtype == np.float32
    train, val = split_indices(len(x), spec.val_fraction, seed)
    if regression and spec.classes is not None:
        raise SpecError("data.classes: given, but the labels are floats (regression)")
    num_outputs = 1 if regression else spec.classes or int(y.max()) + 1
    info = DatasetInfo(
        input_shape=tuple(x.shape[1:]),
        num_outputs=num_outputs,
        task="regression" if regression else "classification",
        image_shape=image_shape,
    )
    return Dataset(x[train], y[train], x[val], y[val], info)

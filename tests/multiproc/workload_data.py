"""Data for ``test_workloads.py``: scikit-learn's digits (and the token corpus) written as files of every
format polytrain reads, plus the in-memory equivalents, a map-style dataset factory and a user loss.

``python workload_data.py OUT_DIR`` writes everything under OUT_DIR (see `write_all`). The ranks import this
module by name (``workload_data:digits_dataset``, ``workload_data:smoothed_ce``), with this folder on
PYTHONPATH; it imports no framework at module level.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SIDE = 16  # digits' 8×8 images upscaled to 16×16 grey PNGs
SMOOTHING = 0.1  # of the user loss
TOKENS = {"samples": 1024, "seq_len": 16, "vocab": 16}  # the in-memory `tokens` data the token file holds


def digits() -> tuple[np.ndarray, np.ndarray]:
    """Exactly what ``data.name: digits`` trains on: (1797, 64) float32 in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """Digits as 16×16 uint8 grey images, in class-folder order (label, then index): the order the images
    source lists them, so its seeded train/validation split picks the same images as the npz's."""
    from PIL import Image

    x, y = digits()
    small = np.rint(x.reshape(-1, 8, 8) * 255).astype(np.uint8)
    big = np.stack([np.asarray(Image.fromarray(img).resize((IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BILINEAR))
                    for img in small])
    order = np.lexsort((np.arange(len(y)), y))
    return big[order], y[order]


def write_parquet(x: np.ndarray, y: np.ndarray, folder: Path) -> None:
    """Two files, row groups of 128 rows; every row once, in digits' order. Columns: ``pixels`` (a fixed-size
    array of 64 floats), ``p0`` … ``p63`` (the same values as scalar columns) and ``label``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    half = len(x) // 2
    for part, rows in enumerate((slice(0, half), slice(half, len(x)))):
        xs, ys = x[rows], y[rows]
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(xs.reshape(-1)), xs.shape[1])
        columns = {"pixels": pixels, **{f"p{i}": xs[:, i] for i in range(xs.shape[1])}, "label": ys}
        pq.write_table(pa.table(columns), folder / f"part-{part}.parquet", row_group_size=128)


def write_csv(x: np.ndarray, y: np.ndarray, path: Path) -> None:
    header = ",".join([*(f"p{i}" for i in range(x.shape[1])), "label"])
    lines = [header] + [",".join([*(repr(float(v)) for v in row), str(int(label))]) for row, label in zip(x, y)]
    path.write_text("\n".join(lines) + "\n")


def write_images(images: np.ndarray, labels: np.ndarray, root: Path) -> None:
    from PIL import Image

    for i, (img, label) in enumerate(zip(images, labels)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i:04d}.png")


def write_parquet_images(images: np.ndarray, labels: np.ndarray, path: Path) -> None:
    """The images as PNG bytes in a Parquet table the way HF ``datasets`` stores an Image feature (a struct of
    bytes and path), in row groups of 128 rows."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    blobs = []
    for img in images:
        buffer = io.BytesIO()
        Image.fromarray(img).save(buffer, format="PNG")
        blobs.append({"bytes": buffer.getvalue(), "path": None})
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array(blobs, type=image_type), "label": pa.array(labels.astype(np.int64))})
    pq.write_table(table, path, row_group_size=128)


def write_tokens(path: Path) -> None:
    """The `tokens` corpus, sequence after sequence: ``seq_len + 1``-token windows of the file are its samples."""
    from polytrain.data import token_corpus
    from polytrain.spec.tables import TokenSpec

    path.write_bytes(token_corpus(TokenSpec(**TOKENS)).astype(np.uint16).tobytes())


def write_all(out: Path) -> dict[str, str]:
    """Every file, and where it is: parquet (folder), csv, images (folder), images_npz, tokens, images_parquet."""
    out.mkdir(parents=True, exist_ok=True)
    x, y = digits()
    write_parquet(x, y, out / "parquet")
    write_csv(x, y, out / "digits.csv")
    images, labels = digit_images()
    write_images(images, labels, out / "images")
    natural = np.argsort(np.lexsort((np.arange(len(y)), y)))  # back to digits' order: row groups mix labels
    write_parquet_images(images[natural], labels[natural], out / "images.parquet")
    np.savez(out / "images.npz", x=(images[:, None].astype(np.float32) / 255.0), y=labels)
    write_tokens(out / "tokens.bin")
    return {"parquet": str(out / "parquet"), "csv": str(out / "digits.csv"), "images": str(out / "images"),
            "images_npz": str(out / "images.npz"), "tokens": str(out / "tokens.bin"),
            "images_parquet": str(out / "images.parquet")}


class DigitsDataset:
    """A map-style dataset of the user's own: item i is (64 floats, label)."""

    def __init__(self) -> None:
        self.x, self.y = digits()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.x[i], self.y[i]


def digits_dataset() -> DigitsDataset:
    """``data.factory: workload_data:digits_dataset``."""
    return DigitsDataset()


def smoothed_ce(out: Any, y: Any) -> Any:
    """A user loss (PyTorch): cross-entropy with label smoothing, one value per sample."""
    import torch

    logp = torch.log_softmax(out, dim=-1)
    picked = logp.gather(1, y.view(-1, 1)).squeeze(1)
    return -(1.0 - SMOOTHING) * picked - SMOOTHING * logp.mean(dim=-1)


def smoothed_ce_tf(out: Any, y: Any) -> Any:
    """The same loss in TensorFlow."""
    import tensorflow as tf

    logp = tf.nn.log_softmax(out, axis=-1)
    picked = tf.gather(logp, tf.cast(y, tf.int32), axis=1, batch_dims=1)
    return -(1.0 - SMOOTHING) * picked - SMOOTHING * tf.reduce_mean(logp, axis=-1)


if __name__ == "__main__":
    print(write_all(Path(sys.argv[1])))

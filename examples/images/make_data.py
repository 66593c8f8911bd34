"""Write scikit-learn's handwritten digits (bundled: no download) as a class-per-folder tree of PNG images.

    python examples/images/make_data.py [OUT_DIR]     # default: examples/images/data

``OUT_DIR/train/<digit>/<n>.png`` and ``OUT_DIR/val/<digit>/<n>.png`` (a fifth of each class, chosen with a
fixed seed): the layout of torchvision's ImageFolder and Keras' ``image_dataset_from_directory``. Each 8×8
image is upscaled to 16×16 grey (bilinear); examples/images/spec.yaml trains a convnet on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

SIDE = 16


def main(out: Path) -> None:
    bunch = load_digits()
    pixels = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    val = np.zeros(len(pixels), dtype=bool)
    rng = np.random.default_rng(0)
    for digit in range(10):  # a fifth of every class for validation
        members = np.flatnonzero(bunch.target == digit)
        val[rng.choice(members, size=len(members) // 5, replace=False)] = True
    for i, (image, digit) in enumerate(zip(pixels, bunch.target)):
        folder = out / ("val" if val[i] else "train") / str(digit)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).resize((SIDE, SIDE), Image.Resampling.BILINEAR).save(folder / f"{i:04d}.png")
    print(f"wrote {int((~val).sum())} training and {int(val.sum())} validation images ({SIDE}x{SIDE} grey PNG) "
          f"under {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")

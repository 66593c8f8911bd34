"""Tokenise text bundled with scikit-learn (its datasets' descriptions: no download) into token files.

    python examples/tokens/make_data.py [OUT_DIR]     # default: examples/tokens/data

Character-level, like nanoGPT's shakespeare_char ``prepare.py``: every distinct character gets an id (sorted),
the text is written as ``uint16`` ids, the first 90 % to ``OUT_DIR/train.bin``, the rest to ``OUT_DIR/val.bin``,
and the vocabulary to ``OUT_DIR/meta.json``. examples/tokens/spec.yaml trains the zoo's transformer on them
(samples are windows of ``seq_len + 1`` tokens).
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np


def corpus() -> str:
    """The reStructuredText descriptions of scikit-learn's datasets, in a fixed order (about 43,000 characters)."""
    texts = sorted((p for p in files("sklearn.datasets.descr").iterdir() if p.name.endswith(".rst")),
                   key=lambda p: p.name)
    return "\n".join(p.read_text(encoding="utf-8") for p in texts)


def main(out: Path) -> None:
    text = corpus()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(out / "train.bin")
    ids[cut:].tofile(out / "val.bin")
    (out / "meta.json").write_text(json.dumps({"vocab_size": len(chars), "itos": chars}, ensure_ascii=False))
    print(f"wrote {cut} training and {len(ids) - cut} validation tokens (vocabulary {len(chars)}) under {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")

"""``data.name: token_file`` — a flat binary file of token ids, the layout nanoGPT's ``prepare.py`` writes
(``np.uint16`` or ``np.uint32`` ids, native byte order, nothing else in the file).

Sample ``i`` is the ``i``-th non-overlapping window of ``seq_len + 1`` tokens: ``x = window[:-1]``,
``y = window[1:]``; a remainder shorter than a window is left out. Windows are read with ``os.pread``,
not through an ``np.memmap``: the pages of a map that a reader touches count in the process's resident
memory until the kernel reclaims them, so an epoch over a memory-mapped file shows the whole file in
RSS, where pread's copies last one batch. Measured over one epoch of a 191 MiB file (2 reader threads,
batches of 256 windows of 256 tokens): memmap +195 MiB peak RSS at 1.5 M windows/s, pread +7 MiB at
0.4 M windows/s (100 M tokens/s, far more than a model consumes). Without
``data.vocab`` the vocabulary is the largest id + 1, found by one chunked scan when the file is opened;
with it, every batch is checked against it as it is read. Map-style: the epoch's order is a full shuffle.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from polytrain.data.files import RawFile, assemble, check_apart, check_inferred, pair
from polytrain.data.plan import shuffled
from polytrain.data.source import Data, DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.tables import DataSpec

_SCAN_TOKENS = 1 << 22  # ids read at a time by the vocabulary scan (8-16 MiB)


class TokenFileSource:
    """Non-overlapping windows of ``seq_len + 1`` tokens of one file."""

    def __init__(self, path: Path, field: str, dtype: str, seq_len: int) -> None:
        if not path.is_file():
            raise SpecError(f"data.{field}: {path} is not a file (token_file: a flat binary file of token ids)")
        self.path, self.field, self.seq_len = path, field, seq_len
        self.dtype = np.dtype(dtype)
        size = path.stat().st_size
        if size == 0:
            raise SpecError(f"data.{field}: {path} is empty")
        if size % self.dtype.itemsize:
            raise SpecError(f"data.dtype: {path} has {size} bytes, not a multiple of {dtype}'s "
                            f"{self.dtype.itemsize} (wrong data.dtype?)")
        self.tokens = size // self.dtype.itemsize
        self.windows = self.tokens // (seq_len + 1)
        if self.windows == 0:
            raise SpecError(f"data.seq_len: {path} holds {self.tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.raw = RawFile(path)
        self.vocab: int | None = None

    def largest_id(self) -> int:
        """The largest id in the file, read in chunks (resident memory stays at one chunk)."""
        largest, step = 0, _SCAN_TOKENS * self.dtype.itemsize
        with open(self.path, "rb") as handle:
            fd = handle.fileno()
            for offset in range(0, self.tokens * self.dtype.itemsize, step):
                chunk = np.frombuffer(os.pread(fd, step, offset), dtype=self.dtype)
                largest = max(largest, int(chunk.max()))
        return largest

    def __len__(self) -> int:
        return self.windows

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        width = self.seq_len + 1
        nbytes = width * self.dtype.itemsize
        windows = np.empty((len(indices), width), dtype=np.int64)
        for k, i in enumerate(indices):
            windows[k] = np.frombuffer(self.raw.read(int(i) * nbytes, nbytes), dtype=self.dtype)
        if self.vocab is not None and len(indices) and windows.max() >= self.vocab:
            k = int(np.argmax(windows.max(axis=1) >= self.vocab))
            raise SpecError(f"data.vocab: {self.path} has token id {int(windows[k].max())} (window {int(indices[k])}), "
                            f"not below data.vocab {self.vocab}")
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self), seed, epoch)


def open_token_file(spec: DataSpec, seed: int) -> Data:
    """``data.path``: the token file (``data.val_path``: a second one, e.g. nanoGPT's ``val.bin``)."""
    assert spec.path is not None and spec.seq_len is not None
    train = TokenFileSource(Path(spec.path), "path", spec.dtype, spec.seq_len)
    val = TokenFileSource(Path(spec.val_path), "val_path", spec.dtype, spec.seq_len) if spec.val_path else None
    if val is not None:
        check_apart([train.path], [val.path])
    if spec.vocab is not None:
        vocab = spec.vocab
    else:
        vocab = 0
        for source in [train] if val is None else [train, val]:
            largest = source.largest_id()
            check_inferred(largest, f"data.{source.field}: {source.path}", "data.vocab", "token id")
            vocab = max(vocab, largest + 1)
    for source in (train, val):
        if source is not None:
            source.vocab = vocab
    info = DatasetInfo(input_shape=(spec.seq_len,), num_outputs=max(vocab, 2), task="next_token")
    return assemble(*pair(train, val, spec.val_fraction, seed), info,
                    f"every window of seq_len + 1 = {spec.seq_len + 1} tokens once per epoch, fully shuffled")

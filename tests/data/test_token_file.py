"""data.name: token_file — flat binary token ids written with numpy.tofile, as nanoGPT's prepare.py does."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
from specs import data_spec

from polytrain.data.token_file import TokenFileSource, open_token_file


def write(path: Path, tokens: np.ndarray) -> Path:
    tokens.tofile(path)
    return path


spec = partial(data_spec, "token_file", seq_len=7)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_read_back(tmp_path: Path, dtype: str) -> None:
    offset = 70000 if dtype == "uint32" else 0  # ids above uint16's range
    tokens = (np.arange(8 * 50 + 5) + offset).astype(dtype)  # 50 windows of 8, and 5 left over
    source = TokenFileSource(write(tmp_path / "train.bin", tokens), "path", dtype, 7)
    assert len(source) == 50
    indices = np.array([49, 0, 17])
    x, y = source.read(indices)
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (3, 7)
    for row, i in enumerate(indices):
        window = tokens[i * 8:(i + 1) * 8].astype(np.int64)
        np.testing.assert_array_equal(x[row], window[:-1])
        np.testing.assert_array_equal(y[row], window[1:])


def test_info_vocab_from_a_scan_or_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import polytrain.data.token_file as module

    monkeypatch.setattr(module, "_SCAN_TOKENS", 64)  # several chunks
    tokens = np.random.default_rng(0).integers(0, 500, size=8 * 40).astype(np.uint16)
    tokens[123] = 611
    path = write(tmp_path / "train.bin", tokens)
    data = open_token_file(spec(path), seed=0)
    assert (data.info.input_shape, data.info.num_outputs, data.info.task) == ((7,), 612, "next_token")
    assert open_token_file(spec(path, vocab=1000), seed=0).info.num_outputs == 1000
    assert "seq_len + 1 = 8" in data.guarantee


def test_val_path_or_val_fraction(tmp_path: Path) -> None:
    train = write(tmp_path / "train.bin", np.arange(8 * 30, dtype=np.uint16))
    val = write(tmp_path / "val.bin", np.arange(1000, 1000 + 8 * 4, dtype=np.uint16))
    data = open_token_file(spec(train, val_path=str(val)), seed=0)
    assert (len(data.train), len(data.val), data.info.num_outputs) == (30, 4, 1032)
    assert data.val.read(np.arange(4))[0][:, 0].tolist() == [1000, 1008, 1016, 1024]
    split = open_token_file(spec(train, val_fraction=0.1), seed=0)
    assert (len(split.train), len(split.val)) == (27, 3)


def test_exactly_once_across_ranks_and_micro_steps(tmp_path: Path, exactly_once) -> None:
    data = open_token_file(spec(write(tmp_path / "t.bin", np.arange(8 * 61 + 3, dtype=np.uint16))), seed=0)
    ids = lambda x, y: x[:, 0] // 8
    exactly_once(data.train.parent, ids, list(range(61)))
    exactly_once(data.train, ids, ids(*data.train.read(np.arange(len(data.train)))).tolist())

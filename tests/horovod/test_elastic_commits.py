"""The ``hvd.elastic`` commit format, one encoder for both frameworks: commits written before stay readable.

The two files in ``fixtures/`` were written by the encoders as they were before they became one
(as of commit fd08adf: ``polytrain.horovod.torch.elastic_store.write_state`` for ``torch_snapshot()`` — now
``polytrain.horovod.torch.elastic.write_state`` —
``polytrain.horovod.common.elastic_files.write_state`` for ``numpy_snapshot()``). Today's code must
read them back to the same values and write the same snapshots to the same file: a job restarted
across an upgrade resumes from its last commit, and a sync between ranks of different versions agrees.
"The same file" is the same header (as JSON) and the same tensor bytes: safetensors writes the two
metadata entries in an order that varies from process to process, so whole files differ run to run.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polytrain.horovod.common import elastic_files

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TORCH_COMMIT = FIXTURES / "elastic-commit-torch.safetensors"
NUMPY_COMMIT = FIXTURES / "elastic-commit-numpy.safetensors"


def numpy_snapshot() -> dict[Any, Any]:
    """What a TensorFlow state commits: plain values and numpy arrays (variables copied to the host)."""
    return {"objects": {"epoch": 3, "batch": 0, 5: "int key", "best": (0.25, None, "val_loss"),
                        "flag": np.bool_(True), "lr": np.float32(0.125), "inf": float("inf")},
            "model": [np.arange(6, dtype=np.float32).reshape(2, 3) / 8, np.array([-1.5, 2.0], np.float64),
                      np.array(7, np.int64), np.zeros((0, 2), np.float16)],
            "optimizer": [np.array(4, np.int64), np.full((2, 3), 0.5, np.float32)]}


def torch_snapshot() -> dict[str, Any]:
    """What a TorchState commits: plain values, and a model's and an optimizer's state dicts (module versions
    in the OrderedDict's ``_metadata``, a bf16 tensor, an integer tensor, numpy values among the plain ones)."""
    import torch

    model: OrderedDict[str, Any] = OrderedDict([
        ("0.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4) / 16),
        ("0.bias", torch.tensor([0.5, -1.0, 2.0])),
        ("1.num_batches_tracked", torch.tensor(3)),
        ("2.half", torch.tensor([1.5, -0.25], dtype=torch.bfloat16))])
    model._metadata = OrderedDict([("", {"version": 1}), ("1", {"version": 2})])  # type: ignore[attr-defined]
    optimizer = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.full((3,), 0.125)}},
                 "param_groups": [{"lr": 0.01, "betas": (0.8, 0.9), "params": [0]}]}
    plain = {1: "int key", ("t", 2): [1.5, float("inf"), True, None], "a": np.arange(6).reshape(2, 3),
             "s": np.int64(7), "empty": {}}
    return {"objects": plain, "handled": {"model": model, "optimizer": optimizer}}


def torch_elastic() -> Any:
    """The shim's module (the package's ``elastic`` attribute is real Horovod's when that is installed)."""
    return importlib.import_module("polytrain.horovod.torch.elastic")


def assert_same(value: Any, expected: Any, where: str = "state") -> None:
    """Equal values of the same types (tensors and arrays by dtype, shape, device and elements)."""
    assert type(value) is type(expected), (where, type(value), type(expected))
    if isinstance(expected, np.ndarray) or isinstance(expected, np.generic):
        assert value.dtype == expected.dtype and np.shape(value) == np.shape(expected), where
        assert np.array_equal(value, expected), where
    elif type(expected).__module__.startswith("torch"):
        import torch

        assert (value.dtype, value.shape, value.device) == (expected.dtype, expected.shape, expected.device), where
        assert torch.equal(value, expected), where
    elif isinstance(expected, dict):
        assert list(value) == list(expected), where
        for key in expected:
            assert_same(value[key], expected[key], f"{where}[{key!r}]")
        if hasattr(expected, "_metadata"):
            assert_same(value._metadata, dict(expected._metadata), f"{where}._metadata")
    elif isinstance(expected, (list, tuple)):
        assert len(value) == len(expected), where
        for i, (got, want) in enumerate(zip(value, expected)):
            assert_same(got, want, f"{where}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(value), where
    else:
        assert value == expected, where


def assert_same_file(data: bytes, expected: bytes) -> None:
    """The same safetensors file: header (tensor names, dtypes, shapes, offsets, metadata) and tensor bytes."""
    (length,) = struct.unpack("<Q", data[:8])
    (expected_length,) = struct.unpack("<Q", expected[:8])
    assert length == expected_length
    assert json.loads(data[8:8 + length]) == json.loads(expected[8:8 + length])
    assert data[8 + length:] == expected[8 + length:]


def commit_dir(tmp_path: Path, fixture: Path) -> Path:
    """A private directory holding ``fixture`` as its commit, the way a restarted job finds it."""
    directory = elastic_files.private_dir(tmp_path / "commits")
    assert directory is not None
    shutil.copyfile(fixture, directory / elastic_files.STATE_FILE)
    return directory


def test_a_numpy_commit_written_before_reads_back_and_is_written_the_same(tmp_path: Path) -> None:
    back = elastic_files.read_state(commit_dir(tmp_path, NUMPY_COMMIT))
    assert_same(back, numpy_snapshot())
    assert_same_file(elastic_files.encode_state(numpy_snapshot()), NUMPY_COMMIT.read_bytes())
    written = elastic_files.write_state(tmp_path / "new", numpy_snapshot())
    assert_same_file(written.read_bytes(), NUMPY_COMMIT.read_bytes())


def test_a_torch_commit_written_before_reads_back_and_is_written_the_same(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    elastic_store = torch_elastic()
    back = elastic_store.read_state(commit_dir(tmp_path, TORCH_COMMIT))
    assert_same(back, torch_snapshot())
    written = elastic_store.write_state(tmp_path / "new", torch_snapshot())
    assert_same_file(written.read_bytes(), TORCH_COMMIT.read_bytes())


def test_either_framework_reads_the_others_commit(tmp_path: Path) -> None:
    """A torch commit without bf16 tensors reads in numpy (tensors become arrays); a numpy one in torch."""
    torch = pytest.importorskip("torch")
    elastic_store = torch_elastic()

    snapshot = {"w": torch.arange(4, dtype=torch.float32), "epoch": 2, "a": np.arange(3, dtype=np.int32)}
    elastic_store.write_state(tmp_path / "torch", snapshot)
    assert_same(elastic_files.read_state(tmp_path / "torch"),
                {"w": np.arange(4, dtype=np.float32), "epoch": 2, "a": np.arange(3, dtype=np.int32)})
    back = elastic_store.read_state(commit_dir(tmp_path, NUMPY_COMMIT))
    assert_same(back, numpy_snapshot())
    # numpy values alone: both frameworks write the same bytes
    assert_same_file(elastic_store.write_state(tmp_path / "t", numpy_snapshot()).read_bytes(), NUMPY_COMMIT.read_bytes())


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_value_without_a_tensor_dtype_is_refused_naming_it(framework: str, tmp_path: Path) -> None:
    if framework == "torch":
        pytest.importorskip("torch")
        write_state = torch_elastic().write_state
    else:
        write_state = elastic_files.write_state
    with pytest.raises(TypeError, match=r"cannot persist state\['names'\]: a numpy <U1 value has no tensor dtype"):
        write_state(tmp_path / "d", {"epoch": 1, "names": np.array(["a", "b"])})
    with pytest.raises(TypeError, match=r"cannot persist state\['x'\]\[0\] \(a object\) without pickle; commit only"):
        write_state(tmp_path / "d", {"x": [object()]})
    assert not (tmp_path / "d").exists() or list((tmp_path / "d").iterdir()) == []

"""Checkpoint format: atomic saves, keep_last, verification of partial/corrupt files, resolution."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from polytrain.checkpoint import store as ckpt

#: what every checkpoint's manifest holds besides what save_checkpoint adds (polytrain.checkpoint.manifest)
POSITION = {"world_size": 1, "epoch": 0, "step_in_epoch": 0}


def tensors(seed: int, size: int = 1000) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal((size, 10)).astype(np.float32), "b": np.zeros(10, np.float32)},
            "optimizer": {"w/exp_avg": rng.standard_normal((size, 10)).astype(np.float32),
                          "w/step": np.array(3.0, np.float32)}}


def test_roundtrip_latest_and_keep_last(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(tmp_path, step, tensors(step), {**POSITION, "epoch": 1}, keep_last=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-00000030", "step-00000040"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000040"
    manifest, loaded = ckpt.load_checkpoint(ckpt.find_latest(tmp_path))
    assert manifest["global_step"] == 40 and manifest["epoch"] == 1 and manifest["format_version"] == 1
    for stem, state in tensors(40).items():
        for name, arr in state.items():
            np.testing.assert_array_equal(loaded[stem][name], arr)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest", "garbage_manifest"])
def test_damaged_newest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    ckpt.save_checkpoint(tmp_path, 1, tensors(1), POSITION)
    newest = ckpt.save_checkpoint(tmp_path, 2, tensors(2), POSITION)
    target = newest / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.verify(newest)
    assert "\n" not in str(info.value)
    assert ckpt.find_latest(tmp_path).name == "step-00000001"


def test_resolve(tmp_path: Path) -> None:
    assert ckpt.resolve("auto", tmp_path / "none") is None
    saved = ckpt.save_checkpoint(tmp_path, 5, tensors(5), POSITION)
    assert ckpt.resolve("auto", tmp_path) == saved
    assert ckpt.resolve(str(tmp_path), tmp_path / "other") == saved  # a checkpoint root
    assert ckpt.resolve(str(saved), tmp_path) == saved
    with pytest.raises(ckpt.CheckpointError, match="--resume: .* does not exist"):
        ckpt.resolve(str(tmp_path / "missing"), tmp_path)


WRITER = """
import sys, numpy as np
from pathlib import Path
from polytrain.checkpoint import store as ckpt
root = Path(sys.argv[1])
rng = np.random.default_rng(0)
big = {"model": {"w": rng.standard_normal((2_000_000,)).astype(np.float32)},
       "optimizer": {"w/exp_avg": rng.standard_normal((2_000_000,)).astype(np.float32)}}
step = int(sys.argv[2])
while True:
    step += 1
    big["model"]["w"][0] = step
    ckpt.save_checkpoint(root, step, big, {"epoch": 0, "world_size": 1, "step_in_epoch": 0}, keep_last=2)
    print(step, flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_kill_during_saves_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    """SIGKILL a writer at 20 random moments (fixed seed); resume always finds a complete checkpoint."""
    rng = random.Random(1234)
    ckpt.save_checkpoint(tmp_path, 0, tensors(0), POSITION)
    passed = 0
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "1000"], stdout=subprocess.PIPE,
                                text=True)
        time.sleep(rng.uniform(0.3, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        latest = ckpt.find_latest(tmp_path)
        assert latest is not None
        manifest, loaded = ckpt.load_checkpoint(latest)  # verifies sizes and hashes
        if manifest["global_step"] > 1000:
            assert loaded["model"]["w"][0] == manifest["global_step"]
        passed += 1
    assert passed == 20
    assert len(ckpt.complete_checkpoints(tmp_path)) >= 1
    json.loads((ckpt.find_latest(tmp_path) / "manifest.json").read_text())


def test_scalars_stay_scalars(tmp_path: Path) -> None:
    """Adam's ``step`` is 0-d in both frameworks; a checkpoint must not turn it into shape (1,)."""
    path = ckpt.save_checkpoint(tmp_path, 3, tensors(3), POSITION)
    _, loaded = ckpt.load_checkpoint(path)
    assert loaded["optimizer"]["w/step"].shape == () and loaded["optimizer"]["w/step"] == 3.0
    assert loaded["optimizer"]["w/exp_avg"].shape == (1000, 10)


def test_resume_auto_hashes_each_file_once_and_still_sees_a_later_change(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume auto`` verifies the checkpoint it picks, then loads it: the tensor files are read for
    their hash once, not twice; a file rewritten after that check is still caught when loaded."""
    ckpt.save_checkpoint(tmp_path, 10, tensors(10), POSITION)
    hashed: list[str] = []
    real = ckpt._sha256
    monkeypatch.setattr(ckpt, "_sha256", lambda path: hashed.append(path.name) or real(path))
    path = ckpt.resolve("auto", tmp_path)
    ckpt.load_checkpoint(path)
    assert sorted(hashed) == ["model.safetensors", "optimizer.safetensors"]
    model = path / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped
    model.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.load_checkpoint(path)

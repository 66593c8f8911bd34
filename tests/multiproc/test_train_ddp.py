"""The default job on 2 real processes under torchrun, mpirun and `polytrain launch --launcher local`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, REPO, check, free_port, read_metrics, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SPEC = REPO / "examples" / "digits.yaml"
PY = [sys.executable, "-m", "polytrain.cli"]


def read_manifest(out: Path) -> dict:
    return json.loads((out / "model.json").read_text())


def assert_trained(out: Path, world: int, backend: str = "ddp") -> dict:
    manifest = read_manifest(out)
    assert manifest["world_size"] == world and manifest["backend"] == backend
    digests = manifest["rank_state_digests"]
    assert len(digests) == world and len(set(digests)) == 1, f"ranks disagree on the weights: {digests}"
    assert manifest["val_accuracy"] >= 0.95, manifest["val_accuracy"]
    return manifest


def test_torchrun_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "polytrain.cli", "train", str(SPEC), "--set", f"output={out}"]
    result = check(run(cmd))
    manifest = assert_trained(out, 2)
    assert "launcher: torchrun" in result.stderr and "validation accuracy:" in result.stderr
    assert result.stderr.count("validation accuracy:") == 1  # rank 0 alone prints
    epochs = read_metrics(out, "epoch")
    assert len(epochs) == manifest["spec"]["loop"]["epochs"]
    assert epochs[-1]["val_accuracy"] == manifest["val_accuracy"]


@pytest.mark.timeout(150)
def test_torchrun_one_rank_with_ddp(tmp_path: Path) -> None:
    """One worker under torchrun: its one-rank group must not wait on the agent's store (it did, 300 s)."""
    out = tmp_path / "one"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "polytrain.cli", "train", str(SPEC), "--set", f"output={out}", "--set", "backend=ddp"]
    check(run(cmd, timeout=120))
    assert_trained(out, 1)


def test_mpirun_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "mpirun"
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", *PY, "train", str(SPEC), "--set", f"output={out}"]
    result = check(run(cmd))
    assert_trained(out, 2)
    assert "launcher: openmpi" in result.stderr


def test_polytrain_launch_local_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "local"
    cmd = [*PY, "launch", "--launcher", "local", "-np", "2", str(SPEC), "--set", f"output={out}"]
    result = check(run(cmd))
    assert_trained(out, 2)
    assert "launcher: polytrain-local" in result.stderr


def test_saved_model_reloads_into_a_plain_model(tmp_path: Path) -> None:
    """The final safetensors holds a plain state_dict: a fresh single-process model reproduces the accuracy."""
    torch = pytest.importorskip("torch")
    from polytrain import validation
    from polytrain.adapters.torch.models import build_model
    from polytrain.checkpoint.store import read_model
    from polytrain.data import load_dataset

    out = tmp_path / "single"
    check(run([*PY, "train", str(SPEC), "--set", f"output={out}", "--set", "loop.epochs=8"]))
    state, manifest = read_model(out)
    spec = validation.from_dict(manifest["spec"])
    data = load_dataset(spec.data, spec.seed)
    model = build_model(spec.model.name, spec.model.params, data.info)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_val)).argmax(1).numpy()
    assert np.mean(pred == data.y_val) == pytest.approx(manifest["val_accuracy"])
    assert manifest["world_size"] == 1 and manifest["backend"] == "local"

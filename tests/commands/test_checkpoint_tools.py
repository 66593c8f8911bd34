"""`polytrain checkpoint inspect|convert|import` on a real trained run."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polytrain.checkpoint.manifest import sealed_text  # noqa: E402
from polytrain.checkpoint.store import find_latest, load_checkpoint  # noqa: E402

CLI = [sys.executable, "-m", "polytrain.cli"]
SPEC = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    proc = cli("train", SPEC, "--quiet", "--set", "loop.epochs=2", "--set", f"output={out}",
               "--set", "checkpoint.every_n_epochs=1", "--set", "optimizer.name=adam", "--set", "optimizer.lr=0.002",
               "--set", "optimizer.momentum=0")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_inspect_lists_tensors_and_position(run_dir: Path) -> None:
    proc = cli("checkpoint", "inspect", run_dir / "checkpoints")
    assert proc.returncode == 0, proc.stderr
    assert "global_step  90" in proc.stdout and "hidden.0.weight" in proc.stdout
    assert "optimizer: 18 tensors" in proc.stdout  # exp_avg, exp_avg_sq, step for 6 parameters


@pytest.mark.slow
def test_convert_to_torch_loads_without_pickle(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    assert cli("checkpoint", "convert", run_dir, "--to", "torch", "-o", out).returncode == 0
    state = torch.load(out, weights_only=True)
    _, tensors = load_checkpoint(find_latest(run_dir / "checkpoints"))
    assert set(state) == set(tensors["model"])
    for name, value in state.items():
        np.testing.assert_array_equal(value.numpy(), tensors["model"][name])


@pytest.mark.slow
def test_import_torch_state_dict_then_resume(run_dir: Path, tmp_path: Path) -> None:
    wrapped = {f"module.{k}": torch.from_numpy(v) for k, v in load_checkpoint(
        find_latest(run_dir / "checkpoints"))[1]["model"].items()}  # as DDP would have saved it
    torch.save(wrapped, tmp_path / "ddp.pt")
    proc = cli("checkpoint", "import", tmp_path / "ddp.pt", "--spec", SPEC, "-o", tmp_path / "imported")
    assert proc.returncode == 0, proc.stderr
    _, tensors = load_checkpoint(tmp_path / "imported" / "step-00000000")
    assert "hidden.0.weight" in tensors["model"]  # the wrapper prefix is gone
    proc = cli("train", SPEC, "--quiet", "--set", "loop.epochs=1", "--set", f"output={tmp_path / 'again'}",
               "--resume", tmp_path / "imported" / "step-00000000")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_import_refuses_pickle_without_trust(tmp_path: Path) -> None:
    torch.save({"weights": {"a": torch.zeros(2)}, "note": argparse.Namespace(a=1)}, tmp_path / "pickled.pt")
    proc = cli("checkpoint", "import", tmp_path / "pickled.pt", "-o", tmp_path / "x")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs pickle to load; pass --trust-checkpoint" in lines[0]


@pytest.mark.parametrize("damage", ["missing", "not_a_checkpoint"])
def test_bad_paths_are_one_line_errors(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "nothing" if damage == "missing" else tmp_path
    proc = cli("checkpoint", "inspect", path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "neither a polytrain checkpoint nor a model directory" in proc.stderr


FACTORY = """
import os
from pathlib import Path

Path(os.environ["MARKER"]).write_text("imported")


def make(info, **params):
    raise RuntimeError("the manifest's factory ran")
"""


@pytest.mark.slow
def test_convert_runs_no_code_a_manifest_names_unless_told(run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint from elsewhere whose manifest names ``model.name: evil_factory:make`` (a module that writes
    a marker file when imported): ``--to keras`` imports it only with --trust-checkpoint; the user's own
    --spec builds the model without it."""
    (tmp_path / "evil_factory.py").write_text(FACTORY)
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARKER": str(marker)}
    foreign = tmp_path / "foreign"
    shutil.copytree(find_latest(run_dir / "checkpoints"), foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    manifest["spec"]["model"]["name"] = "evil_factory:make"
    manifest["spec"]["loss"] = "evil_factory:make"
    (foreign / "manifest.json").write_text(sealed_text(manifest))  # whole: as its writer sealed it

    def convert(*extra: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "checkpoint", "convert", str(foreign), "--to", "keras", "-o",
                               str(tmp_path / "m.weights.h5"), *map(str, extra)],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)

    proc = convert()
    assert proc.returncode == 2 and not marker.exists()
    [line] = proc.stderr.strip().splitlines()
    assert "model.name 'evil_factory:make'" in line and "--spec SPEC" in line and "--trust-checkpoint" in line
    proc = convert("--spec", SPEC)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists() and (tmp_path / "m.weights.h5").stat().st_size > 0
    proc = convert("--trust-checkpoint")
    assert marker.read_text() == "imported" and proc.returncode != 0  # named by the user: imported and called

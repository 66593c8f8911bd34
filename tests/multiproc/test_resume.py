"""Exact and cross-world-size resume from checkpoints, with real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, free_port, loopback_env, run

from polytrain.checkpoint import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

HERE = Path(__file__).resolve().parent

BASE = ["schedule.decay=none", "optimizer.name=adam", "optimizer.lr=0.003", "optimizer.momentum=0.0",
        "data.global_batch_size=64", "loop.log_every_n_steps=1", "model.params.hidden_sizes=[64]",
        "loop.epochs=2"]


def train(out: Path, nproc: int, sets: list[str], resume: str | None = None,
          env: dict[str, str] | None = None) -> None:
    args = ["train", "--quiet", *[a for s in [*BASE, f"output={out}", *sets] for a in ("--set", s)]]
    if resume:
        args += ["--resume", resume]
    if nproc == 1:
        cmd = [sys.executable, "-m", "polytrain.cli", *args]
    else:
        cmd = [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "polytrain.cli", *args]
    check(run(cmd, env=env))


def step_losses(out: Path) -> dict[int, float]:
    events = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def test_exact_resume_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    """2 ranks: 2 epochs straight == stop at step 30 (mid-epoch 2) + resume; final weights bit-identical."""
    train(tmp_path / "straight", 2, [])
    interrupted = tmp_path / "interrupted"
    train(interrupted, 2, ["loop.max_steps=30", "checkpoint.every_n_steps=10"])
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step-00000030"
    train(interrupted, 2, ["checkpoint.every_n_steps=10"], resume="auto")
    straight, resumed = read_model(tmp_path / "straight"), read_model(interrupted)
    assert resumed[1]["global_step"] == straight[1]["global_step"] == 46
    assert resumed[1]["rank_state_digests"] == straight[1]["rank_state_digests"]
    for name, arr in straight[0].items():
        np.testing.assert_array_equal(resumed[0][name], arr)


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_world_size_continues_the_same_run(tmp_path: Path, nproc: int) -> None:
    """Saved by 2-rank DDP at step 30 (Adam moments included), resumed on 1 or 3 ranks: same losses after."""
    reference = tmp_path / "reference"
    train(reference, 2, ["checkpoint.every_n_steps=30"])
    ref_losses = step_losses(reference)
    resumed = tmp_path / f"resumed{nproc}"
    train(resumed, nproc, [], resume=str(reference / "checkpoints" / "step-00000030"))
    losses = step_losses(resumed)
    assert min(losses) == 31 and max(losses) == 46
    np.testing.assert_allclose([losses[s] for s in range(31, 47)], [ref_losses[s] for s in range(31, 47)],
                               rtol=2e-5)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    out = tmp_path / "a"
    train(out, 1, ["loop.max_steps=5", "checkpoint.every_n_steps=5"])
    args = ["train", "--quiet", *[a for s in [*BASE, f"output={out}", "model.params.hidden_sizes=[32]"]
                                  for a in ("--set", s)], "--resume"]
    result = run([sys.executable, "-m", "polytrain.cli", *args])
    assert result.returncode == 2
    assert result.stderr.strip().startswith("polytrain: error: --resume: ")
    assert "different model/data/seed" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_exact_resume_keeps_the_fp16_loss_scale(tmp_path: Path) -> None:
    """fp16 with dynamic loss scaling: the scale and its growth tracker travel in the checkpoint, so stop +
    resume is bit-identical to a straight run. A NaN forced into step 5 halves the scale first, so a
    resumed run that started again from the initial scale would not match."""
    fp16 = ["precision=fp16", "backend=local", "data.global_batch_size=64", "model.name=nan_model:make"]
    nan_at_5 = loopback_env(PYTHONPATH=str(HERE), NAN_RANK="0", NAN_AT="5")
    train(tmp_path / "straight", 1, [*fp16, "loop.max_steps=40"], env=nan_at_5)
    interrupted = tmp_path / "interrupted"
    train(interrupted, 1, [*fp16, "loop.max_steps=15", "checkpoint.every_n_steps=15"], env=nan_at_5)
    saved = json.loads((interrupted / "checkpoints" / "step-00000015" / "manifest.json").read_text())
    assert saved["loss_scaler"]["scale"] == 32768.0 and saved["lr"] > 0  # halved by the NaN step
    train(interrupted, 1, [*fp16, "loop.max_steps=40"], resume="auto", env=loopback_env(PYTHONPATH=str(HERE)))
    scales = [e["loss_scale"] for e in map(json.loads, (interrupted / "metrics.jsonl").read_text().splitlines())
              if e["event"] == "step" and e["step"] > 15]
    assert scales and set(scales) == {32768.0}
    straight, resumed = read_model(tmp_path / "straight"), read_model(interrupted)
    assert resumed[1]["global_step"] == straight[1]["global_step"] == 40
    for name, arr in straight[0].items():
        np.testing.assert_array_equal(resumed[0][name], arr)

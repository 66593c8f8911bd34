"""Exact and cross-world-size resume from checkpoints, with real processes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from procs import check, losses_by_step, read_metrics, train

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

HERE = Path(__file__).resolve().parent

BASE = ["schedule.decay=none", "optimizer.name=adam", "optimizer.lr=0.003", "optimizer.momentum=0.0",
        "data.global_batch_size=64", "loop.log_every_n_steps=1", "model.params.hidden_sizes=[64]",
        "loop.epochs=2"]


def trained(out: Path, nproc: int, sets: list[str], resume: str | None = None,
            env: Mapping[str, str] | None = None) -> None:
    """``BASE`` and ``sets`` on one process, or ``nproc`` ranks under torchrun; the run must succeed."""
    check(train(out, [*BASE, *sets], nproc=nproc, resume=resume, env=env))


def test_exact_resume_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    """2 ranks: 2 epochs straight == stop at step 30 (mid-epoch 2) + resume; final weights bit-identical."""
    trained(tmp_path / "straight", 2, [])
    interrupted = tmp_path / "interrupted"
    trained(interrupted, 2, ["loop.max_steps=30", "checkpoint.every_n_steps=10"])
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step-00000030"
    trained(interrupted, 2, ["checkpoint.every_n_steps=10"], resume="auto")
    straight, resumed = read_model(tmp_path / "straight"), read_model(interrupted)
    assert resumed[1]["global_step"] == straight[1]["global_step"] == 46
    assert resumed[1]["rank_state_digests"] == straight[1]["rank_state_digests"]
    for name, arr in straight[0].items():
        np.testing.assert_array_equal(resumed[0][name], arr)


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_world_size_continues_the_same_run(tmp_path: Path, nproc: int) -> None:
    """Saved by 2-rank DDP at step 30 (Adam moments included), resumed on 1 or 3 ranks: same losses after."""
    reference = tmp_path / "reference"
    trained(reference, 2, ["checkpoint.every_n_steps=30"])
    ref_losses = losses_by_step(reference)
    resumed = tmp_path / f"resumed{nproc}"
    trained(resumed, nproc, [], resume=str(reference / "checkpoints" / "step-00000030"))
    losses = losses_by_step(resumed)
    assert min(losses) == 31 and max(losses) == 46
    np.testing.assert_allclose([losses[s] for s in range(31, 47)], [ref_losses[s] for s in range(31, 47)],
                               rtol=2e-5)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    out = tmp_path / "a"
    trained(out, 1, ["loop.max_steps=5", "checkpoint.every_n_steps=5"])
    result = train(out, [*BASE, "model.params.hidden_sizes=[32]"], args=["--resume"])
    assert result.returncode == 2
    assert result.stderr.strip().startswith("polytrain: error: --resume: ")
    assert "different model/data/seed" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_exact_resume_keeps_the_fp16_loss_scale(tmp_path: Path) -> None:
    """fp16 with dynamic loss scaling: the scale and its growth tracker travel in the checkpoint, so stop +
    resume is bit-identical to a straight run. A NaN forced into step 5 halves the scale first, so a
    resumed run that started again from the initial scale would not match."""
    fp16 = ["precision=fp16", "backend=local", "data.global_batch_size=64", "model.name=nan_model:make"]
    nan_at_5 = {"PYTHONPATH": str(HERE), "NAN_RANK": "0", "NAN_AT": "5"}
    trained(tmp_path / "straight", 1, [*fp16, "loop.max_steps=40"], env=nan_at_5)
    interrupted = tmp_path / "interrupted"
    trained(interrupted, 1, [*fp16, "loop.max_steps=15", "checkpoint.every_n_steps=15"], env=nan_at_5)
    saved = json.loads((interrupted / "checkpoints" / "step-00000015" / "manifest.json").read_text())
    assert saved["loss_scaler"]["scale"] == 32768.0 and saved["lr"] > 0  # halved by the NaN step
    trained(interrupted, 1, [*fp16, "loop.max_steps=40"], resume="auto", env={"PYTHONPATH": str(HERE)})
    scales = [e["loss_scale"] for e in read_metrics(interrupted, "step") if e["step"] > 15]
    assert scales and set(scales) == {32768.0}
    straight, resumed = read_model(tmp_path / "straight"), read_model(interrupted)
    assert resumed[1]["global_step"] == straight[1]["global_step"] == 40
    for name, arr in straight[0].items():
        np.testing.assert_array_equal(resumed[0][name], arr)


#: 201 synthetic samples, 40 held out: 161 to train on, 7 steps per epoch of a global batch of 25 (the last of 11).
#: Neither 25 nor 11 divides by world size × accumulation (2 × 2, 1 × 2, 3 × 2): ranks and micro-steps get
#: unequal shares (3 ranks: 9/8/8, then 4/4/3).
UNEVEN = ["data.name=synthetic", "data.synthetic.samples=201", "data.synthetic.features=6", "data.synthetic.classes=3",
          "data.val_fraction=0.2", "data.global_batch_size=25", "loop.grad_accum_steps=2", "loop.epochs=2",
          "model.name=seen_model:make", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9"]
STOP, PER_EPOCH, ACCUM = 10, 7, 2


def train_seen(out: Path, nproc: int, sets: list[str], resume: str | None = None) -> dict[int, list[str]]:
    """Run with the recording model; returns {optimizer step: the samples every rank trained on in it}."""
    seen = out / "seen"
    seen.mkdir(parents=True)
    trained(out, nproc, [*UNEVEN, *sets], resume=resume, env={"PYTHONPATH": str(HERE), "SEEN_DIR": str(seen)})
    first = 1 if resume is None else STOP + 1
    steps: dict[int, list[str]] = {}
    for rank in range(nproc):
        lines = (seen / f"rank-{rank}.jsonl").read_text().splitlines()
        for micro, line in enumerate(lines):  # a rank's n-th training forward is its n-th micro-step
            steps.setdefault(first + micro // ACCUM, []).extend(json.loads(line))
    return steps


def training_rows() -> dict[str, int]:
    from polytrain.data import load_dataset
    from polytrain.spec.tables import DataSpec, SyntheticSpec

    data = load_dataset(DataSpec(name="synthetic", val_fraction=0.2,
                                 synthetic=SyntheticSpec(samples=201, features=6, classes=3)), seed=0)
    return {row.tobytes().hex(): i for i, row in enumerate(data.x_train)}


@pytest.fixture(scope="module")
def straight_uneven(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, list[str]], dict]:
    out = tmp_path_factory.mktemp("straight-uneven")
    steps = train_seen(out, 2, [])
    return steps, read_model(out)[0]


@pytest.mark.parametrize("nproc", [1, 3])
def test_mid_epoch_stop_resumed_at_another_world_size_sees_each_sample_once(nproc: int, straight_uneven: tuple,
                                                                           tmp_path: Path) -> None:
    """Stopped by loop.max_steps mid-epoch 2 on 2 ranks, resumed from that checkpoint on 1 or 3 ranks with the same
    global batch: each step trains on the samples of the straight 2-rank run's step (each once per epoch), and
    the run ends on the straight run's weights."""
    straight, final = straight_uneven
    rows = training_rows()
    ids = {step: sorted(rows[row] for row in samples) for step, samples in straight.items()}
    assert sorted(ids) == list(range(1, 2 * PER_EPOCH + 1))
    for epoch in range(2):
        epoch_ids = [i for step in range(epoch * PER_EPOCH + 1, (epoch + 1) * PER_EPOCH + 1) for i in ids[step]]
        assert sorted(epoch_ids) == list(range(len(rows)))  # every sample once per epoch, none twice
    stopped = tmp_path / "stopped"
    before = train_seen(stopped, 2, [f"loop.max_steps={STOP}", "checkpoint.every_n_steps=5"])
    checkpoint = stopped / "checkpoints" / "step-00000010"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (manifest["epoch"], manifest["step_in_epoch"]) == (1, STOP - PER_EPOCH)  # mid-epoch 2
    after = train_seen(tmp_path / "resumed", nproc, [], resume=str(checkpoint))
    assert sorted(before) == list(range(1, STOP + 1)) and sorted(after) == list(range(STOP + 1, 2 * PER_EPOCH + 1))
    got = {step: sorted(rows[row] for row in samples) for step, samples in {**before, **after}.items()}
    assert got == ids
    state, resumed = read_model(tmp_path / "resumed")
    assert resumed["world_size"] == nproc and resumed["global_step"] == 2 * PER_EPOCH
    for name, ref in final.items():  # another world size sums the gradients in another order: rounding only
        assert np.max(np.abs(state[name] - ref)) <= 1e-5 * np.max(np.abs(ref)), name

"""A run never touches another run's checkpoints (issue 26, item 8).

Every checkpoint names the run that wrote it; a resumed run goes on with its checkpoint's run id, a fresh
run has a new one. Before, a fresh run into a checkpoint.dir holding another run's checkpoints (every spec
writes to runs/polytrain by default) replaced the same steps, moved higher ones aside and pruned lower ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import run
from trainer_fakes import FakeJob
from trainer_runs import fit, fit_fails, make_spec, records, saved_steps

from polytrain import checkpoint as ckpt
from polytrain.trainer import Trainer


def save(root: Path, step: int, run_id: str | None, keep_last: int | None = None, **extra: Any) -> Path:
    manifest = {"version": step, **({ckpt.RUN_KEY: run_id} if run_id else {}), **extra}
    return ckpt.save_checkpoint(root, step, {"model": {"w": np.full(10, step, np.float32)}}, manifest,
                                keep_last=keep_last)


def steps(paths: list[Path]) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in paths]


def contents(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path: what must stay exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- the checkpoint layer


def test_a_save_never_replaces_another_runs_step(tmp_path: Path) -> None:
    theirs = save(tmp_path, 10, "run-a")
    before = contents(theirs)
    with pytest.raises(ckpt.CheckpointError) as info:
        save(tmp_path, 10, "run-b")
    assert str(info.value) == (f"checkpoint.dir: {theirs} was written by run run-a, not this one; polytrain never "
                               "replaces another run's checkpoint: choose another checkpoint.dir (or output)")
    assert contents(theirs) == before and not list(tmp_path.glob(".tmp-*"))
    save(tmp_path, 10, "run-a")  # its own run may save the step again


def test_rollback_and_keep_last_touch_only_the_runs_own_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step, "run-a", keep_last=3)
    before = contents(tmp_path)
    for step in (5, 6, 7):  # below and beside run a's steps: a rollback of run b would set a's aside
        save(tmp_path, step, "run-b", keep_last=1)
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [7, 10, 20, 30] and not list(tmp_path.glob("abandoned-*"))
    assert {k: v for k, v in contents(tmp_path).items() if not k.startswith(("step-0000000", "latest"))} == \
        {k: v for k, v in before.items() if k != "latest"}
    save(tmp_path, 25, "run-a", keep_last=2)  # run a's own rollback still sets its own future aside
    [aside] = tmp_path.glob("abandoned-after-step-00000025-*")
    assert steps(sorted(aside.iterdir())) == [30]
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [7, 20, 25]


def test_a_run_resumed_from_before_run_ids_owns_those_of_its_model() -> None:
    owner = ckpt.Owner("new", legacy_digest="digest-1")
    assert owner.owns({"model_digest": "digest-1"}) and owner.owns({ckpt.RUN_KEY: "new"})
    assert not owner.owns({"model_digest": "digest-2"}) and not owner.owns({ckpt.RUN_KEY: "old"})
    assert not ckpt.Owner("new").owns({"model_digest": "digest-1"}) and not owner.owns(None)


def test_temporaries_are_removed_only_when_their_writer_has_ended(tmp_path: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True, timeout=60)
    dead, living = int(ended.stdout), os.getppid()
    for pid in (dead, living):
        (tmp_path / f".tmp-step-00000009-{pid}-1").mkdir()
    save(tmp_path, 10, None, keep_last=3)
    assert [p.name for p in tmp_path.glob(".tmp-*")] == [f".tmp-step-00000009-{living}-1"]


# ---------------------------------------------------------------------------- through the Trainer


def first_run(tmp_path: Path, **checkpoint: Any) -> Any:
    spec = make_spec(tmp_path, loop={"epochs": 2}, checkpoint={"every_n_steps": 3, "keep_last": 3, **checkpoint})
    fit(spec)
    assert saved_steps(spec) == [9, 12, 14]
    return spec


@pytest.mark.parametrize("changes", [{}, {"seed": 4}], ids=["same-spec", "other-model-digest"])
def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_they_stay(tmp_path: Path,
                                                                            changes: dict[str, Any]) -> None:
    spec = first_run(tmp_path)
    before = contents(spec.checkpoint_dir)
    again = make_spec(tmp_path, loop={"epochs": 1}, checkpoint={"every_n_steps": 2, "keep_last": 1}, **changes)
    error, job = fit_fails(again, ckpt.CheckpointError)
    run_id = json.loads((spec.checkpoint_dir / "step-00000014" / "manifest.json").read_text())[ckpt.RUN_KEY]
    assert str(error) == (
        f"checkpoint.dir: {spec.checkpoint_dir} holds checkpoints of another run (step-00000009, step-00000012, "
        f"step-00000014; written by run {run_id}), which this run would replace or prune: resume that run with "
        f"--resume auto, set another output or checkpoint.dir, or pass --overwrite-checkpoints to move them into "
        f"{spec.checkpoint_dir}/superseded-…/ (nothing is deleted)")
    assert job.fw.calls.micro == [] and contents(spec.checkpoint_dir) == before


def test_overwrite_moves_the_other_runs_checkpoints_aside_whole(tmp_path: Path) -> None:
    spec = first_run(tmp_path, monitor="val_loss")
    root = spec.checkpoint_dir
    before = contents(root)
    job = FakeJob()
    Trainer(spec, show_progress=False, overwrite_checkpoints=True, backend_factory=job.backend_factory,
            framework_factory=job.framework_factory).fit()
    [aside] = root.glob("superseded-*")
    assert contents(aside) == before  # every file, best/ and latest included, byte for byte
    assert [ckpt.verify(p)["global_step"] for p in ckpt.complete_checkpoints(aside)] == [9, 12, 14]
    assert saved_steps(spec) == [9, 12, 14] and (root / "latest").read_text().strip() == "step-00000014"
    ours = {json.loads((p / "manifest.json").read_text())[ckpt.RUN_KEY] for p in ckpt.complete_checkpoints(root)}
    theirs = {json.loads((p / "manifest.json").read_text())[ckpt.RUN_KEY] for p in ckpt.complete_checkpoints(aside)}
    assert len(ours) == len(theirs) == 1 and ours != theirs
    [moved] = records(spec, "checkpoints_superseded")
    assert moved["into"] == str(aside) and "latest" in moved["moved"] and "best/index.json" in moved["moved"]


def test_a_resumed_run_goes_on_with_its_run_id_and_prunes_its_own(tmp_path: Path) -> None:
    stopped = make_spec(tmp_path, loop={"epochs": 2, "max_steps": 6}, checkpoint={"every_n_steps": 2, "keep_last": 2})
    fit(stopped)
    run_id = json.loads((stopped.checkpoint_dir / "step-00000006" / "manifest.json").read_text())[ckpt.RUN_KEY]
    spec = make_spec(tmp_path, loop={"epochs": 2}, checkpoint={"every_n_steps": 2, "keep_last": 2})
    fit(spec, resume="auto")
    assert saved_steps(spec) == [12, 14]
    assert {json.loads((p / "manifest.json").read_text())[ckpt.RUN_KEY]
            for p in ckpt.complete_checkpoints(spec.checkpoint_dir)} == {run_id}
    assert json.loads((tmp_path / "model.json").read_text())[ckpt.RUN_KEY] == run_id


def test_checkpoints_from_before_run_ids_resume_and_are_pruned_as_the_runs_own(tmp_path: Path) -> None:
    stopped = make_spec(tmp_path, loop={"epochs": 2, "max_steps": 6}, checkpoint={"every_n_steps": 2, "keep_last": 3})
    fit(stopped)
    for path in ckpt.complete_checkpoints(stopped.checkpoint_dir):  # as polytrain wrote them before
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest[ckpt.RUN_KEY]
        (path / "manifest.json").write_text(json.dumps(manifest))
    error, _ = fit_fails(make_spec(tmp_path, checkpoint={"every_n_steps": 2}), ckpt.CheckpointError)
    assert "written by a run from before run ids" in str(error)
    spec = make_spec(tmp_path, loop={"epochs": 2}, checkpoint={"every_n_steps": 2, "keep_last": 3})
    _, job = fit(spec, resume="auto")
    assert job.fw.calls.micro[0].step == 7 and saved_steps(spec) == [10, 12, 14]


def test_another_runs_best_checkpoints_are_refused_too(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"monitor": "val_loss", "mode": "max"})
    fit(spec)
    best = ckpt.complete_checkpoints(spec.checkpoint_dir / "best")
    assert best and not ckpt.complete_checkpoints(spec.checkpoint_dir)
    error, _ = fit_fails(spec, ckpt.CheckpointError)
    assert f"holds checkpoints of another run (best/{best[0].name}; " in str(error)


# ---------------------------------------------------------------------------- through the CLI


SPEC = """
framework: torch
backend: local
model: {name: mlp, params: {hidden_sizes: [4]}}
data: {name: synthetic, batch_size: 16, synthetic: {samples: 96, features: 4, classes: 2}}
loop: {epochs: 1}
checkpoint: {every_n_steps: 2, keep_last: 2}
output: out
"""


def test_the_cli_refuses_to_start_over_another_run_and_overwrites_only_when_told(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC)

    def train(*args: str) -> subprocess.CompletedProcess[str]:
        return run([sys.executable, "-m", "polytrain.cli", "train", "spec.yaml", "--quiet", *args], cwd=tmp_path,
                   timeout=300)

    assert train().returncode == 0
    root = tmp_path / "out" / "checkpoints"
    before = contents(root)
    refused = train("--set", "loop.epochs=2")
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("polytrain: error: checkpoint.dir: out/checkpoints holds checkpoints of another run ")
    assert "--overwrite-checkpoints" in line and contents(root) == before
    assert train("--set", "loop.epochs=2", "--overwrite-checkpoints").returncode == 0
    [aside] = root.glob("superseded-*")
    assert contents(aside) == before and steps(ckpt.complete_checkpoints(root)) == [8, 10]

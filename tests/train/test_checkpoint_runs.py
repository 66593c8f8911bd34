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
from procs import check, read_metrics, run, train
from trainer_fakes import FakeJob
from trainer_runs import fit, fit_fails, make_spec, records, saved_steps

from polytrain.checkpoint import store as ckpt
from polytrain.train.trainer import Trainer


def save(root: Path, step: int, run_id: str | None, keep_last: int | None = None, **extra: Any) -> Path:
    manifest = {"version": step, "world_size": 1, "epoch": 0, "step_in_epoch": 0,
                **({ckpt.RUN_KEY: run_id} if run_id else {}), **extra}
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
    # issue 48 item 4: a resume is advised only where this spec can resume that run (the same model digest)
    advice = "resume that run with --resume auto, " if not changes else (
        f"that run had another model, data or seed (model digest {spec.model_digest()}, this spec's "
        f"{again.model_digest()}), so this spec cannot resume it: ")
    assert str(error) == (
        f"checkpoint.dir: {spec.checkpoint_dir} holds checkpoints of another run (step-00000009, step-00000012, "
        f"step-00000014; written by run {run_id}), which this run would replace or prune: {advice}"
        f"set another output or checkpoint.dir, or pass --overwrite-checkpoints to move them into "
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
        del manifest[ckpt.RUN_KEY], manifest["manifest_sha256"]  # nor did they record their own digest
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


@pytest.mark.slow
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
    # issue 48 item 4: the advice to resume is given only where this spec can resume that run
    other = train("--set", "loop.epochs=2", "--set", "seed=5")
    assert other.returncode == 2 and contents(root) == before
    [line] = other.stderr.strip().splitlines()
    assert "--resume" not in line and "that run had another model, data or seed (model digest " in line
    assert line.endswith(", so this spec cannot resume it: set another output or checkpoint.dir, or pass "
                         "--overwrite-checkpoints to move them into out/checkpoints/superseded-…/ (nothing is deleted)")
    out = tmp_path / "out"
    logs = contents(out)  # the first run's log, its CSV and TensorBoard events, its final model
    assert train("--set", "loop.epochs=2", "--overwrite-checkpoints").returncode == 0
    [aside] = root.glob("superseded-*")
    assert contents(aside) == before and steps(ckpt.complete_checkpoints(root)) == [8, 10]
    # issue 48 item 4: the first run's logs went aside with its checkpoints; the second's log holds its own only
    [logs_aside] = out.glob("superseded-*")
    assert contents(logs_aside) == {k: v for k, v in logs.items() if not k.startswith("checkpoints/")}
    assert any(k.startswith("tb/") for k in contents(logs_aside))
    assert [r["epoch"] for r in read_metrics(out, "epoch")] == [0, 1]  # the first run's epoch 0 is not among them
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + len(read_metrics(out, "step")) + 2
    [moved] = read_metrics(out, "checkpoints_superseded")
    assert moved["outputs_into"] == str(logs_aside.relative_to(tmp_path)) and "metrics.jsonl" in moved["outputs_moved"]


ROLLBACK = ["loop.epochs=3", "checkpoint.monitor=val_loss", "checkpoint.save_top_k=3", "checkpoint.every_n_epochs=1"]


@pytest.mark.slow
def test_a_rollback_sets_the_best_checkpoints_of_the_abandoned_future_aside(tmp_path: Path) -> None:
    """Issue 48 item 3: after a rollback best/index.json still ranked best checkpoints of later steps (weights the
    resumed run never had), best/latest named one, and the resumed run's validations were compared against them.
    Digits, 45 steps an epoch; resumed from step 45 with batches twice as large: 23 steps an epoch."""
    out = tmp_path / "out"
    root, best = out / "checkpoints", out / "checkpoints" / "best"
    check(train(out, ROLLBACK, timeout=300))
    first = {e["step"]: e["value"] for e in json.loads((best / "index.json").read_text())["best"]}
    assert sorted(first) == [45, 90, 135]
    future = {name: contents(best / name) for name in ("step-00000090", "step-00000135")}
    check(train(out, [*ROLLBACK, "data.batch_size=64"], resume=root / "step-00000045", timeout=300))
    resumed = {r["step"]: r["val_loss"] for r in read_metrics(out, "epoch")[3:]}
    assert sorted(resumed) == [68, 91]
    # ranked against what was kept at step 45 only: both validations enter, whatever steps 90 and 135 scored
    index = json.loads((best / "index.json").read_text())
    assert {e["step"]: e["value"] for e in index["best"]} == {45: first[45], **resumed}
    assert [r["step"] for r in read_metrics(out, "best_checkpoint")] == [45, 90, 135, 68, 91]
    assert steps(ckpt.complete_checkpoints(best)) == [45, 68, 91]
    assert (best / "latest").read_text().strip() == "step-00000091"
    # set aside as the regular ones are, whole and byte for byte
    [aside] = root.glob("abandoned-after-step-00000045-*")
    assert {name: contents(aside / "best" / name) for name in future} == future
    [record] = read_metrics(out, "best_checkpoints_abandoned")
    assert (record["step"], sorted(record["moved"]), record["into"]) == (45, sorted(future), str(aside))
    [regular] = root.glob("abandoned-after-step-00000068-*")
    assert steps(ckpt.complete_checkpoints(regular)) == [90, 135]
    assert steps(ckpt.complete_checkpoints(root)) == [45, 68, 91]


@pytest.mark.slow
def test_a_best_index_that_cannot_be_written_is_one_line_and_the_checkpoint_stays(tmp_path: Path) -> None:
    """Issue 48 item 13: a directory in the way of index.json.tmp was an IsADirectoryError traceback from
    callbacks.py. As a failed checkpoint write: one line naming the file, exit 1, the checkpoint intact."""
    out = tmp_path / "out"
    best = out / "checkpoints" / "best"
    (best / "index.json.tmp").mkdir(parents=True)
    result = train(out, ["loop.epochs=1", "checkpoint.monitor=val_loss"], timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"polytrain: error: checkpoint.dir: cannot write {best / 'index.json'}, the best checkpoints' ranking (Is a "
        f"directory: {best / 'index.json.tmp'}); the checkpoints it ranks are intact; free space or choose another "
        "checkpoint.dir, then resume with --resume auto")
    assert ckpt.load_checkpoint(best / "step-00000045")[0]["global_step"] == 45  # verifies every file's checksum
    assert (best / "index.json.tmp").is_dir() and not (best / "index.json").exists()
    assert not (out / "model.json").exists()



@pytest.mark.parametrize("every", [None, 2], ids=["no checkpoints", "checkpoints elsewhere"])
def test_a_fresh_run_into_an_earlier_runs_output_starts_its_own_log(tmp_path: Path, every: int | None) -> None:
    """Issue 48 item 4, where no checkpoint is claimed: the second fresh run's log holds its records only; the
    first run's log and final model move aside whole (nothing is deleted)."""
    def spec_for(run: str) -> Any:
        return make_spec(tmp_path, loop={"epochs": 1}, checkpoint={"every_n_steps": every,
                                                                   "dir": str(tmp_path / f"ckpt-{run}")})

    first = spec_for("a")
    fit(first)
    before = contents(tmp_path)
    first_steps = [r["step"] for r in records(first, "step")]
    assert first_steps and (tmp_path / "model.json").is_file()
    again = spec_for("b")
    fit(again)
    [aside] = tmp_path.glob("earlier-*")
    moved = contents(aside)
    assert {"metrics.jsonl", "metrics.csv", "model.json"} <= set(moved)
    assert moved == {name: before[name] for name in moved}  # byte for byte, at the same relative places
    [record] = records(again, "earlier_outputs_moved")
    assert record["into"] == str(aside) and "metrics.jsonl" in record["moved"]
    assert [r["step"] for r in records(again, "step")] == first_steps  # its own steps, once each

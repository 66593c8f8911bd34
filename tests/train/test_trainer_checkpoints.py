"""The Trainer's checkpoints (polytrain/train/checkpoints.py), on the fakes (tests/trainer_runs.py): when they are
written, what their manifests record, pruning, a checkpoint that cannot be written, and resuming from them bit for
bit (another world size, an elastic restart, a finished run, another model refused)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from trainer_fakes import BIAS, WEIGHT, FakeFramework, FakeJob
from trainer_runs import (
    PER_EPOCH,
    TWO,
    final_state,
    fit,
    fit_fails,
    make_spec,
    manifest,
    records,
    sample_ids,
    saved_steps,
)

from polytrain.checkpoint import store as ckpt
from polytrain.errors import TrainingFailure
from polytrain.spec.tables import TrainSpec
from polytrain.world import World

# --------------------------------------------------------------------------- checkpoints


def test_checkpoints_every_n_steps_and_the_final_state(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_steps": 3, "keep_last": 10})
    fit(spec)
    assert saved_steps(spec) == [3, 6, 9, 12, 14]  # 14 is not a multiple of 3: saved as the final state
    assert [r["step"] for r in records(spec, "checkpoint")] == [3, 6, 9, 12, 14]
    positions = {s: (manifest(spec, s)["epoch"], manifest(spec, s)["step_in_epoch"]) for s in saved_steps(spec)}
    assert positions == {3: (0, 3), 6: (0, 6), 9: (1, 2), 12: (1, 5), 14: (2, 0)}
    assert manifest(spec, 9)["samples_in_epoch"] == 24 and manifest(spec, 9)["global_batch"] == 12
    assert manifest(spec, 9)["rng_states"] == [[spec.seed, 0]]
    assert (spec.checkpoint_dir / "latest").read_text().strip() == "step-00000014"
    last = load_file(str(spec.checkpoint_dir / "step-00000014" / "model.safetensors"))
    assert ckpt.state_digest(last) == ckpt.state_digest(final_state(spec))
    optimizer = load_file(str(spec.checkpoint_dir / "step-00000014" / "optimizer.safetensors"))
    assert sorted(optimizer) == [f"{BIAS}/momentum_buffer", f"{WEIGHT}/momentum_buffer"]


def test_a_step_checkpoint_on_an_epoch_boundary_is_saved_once_as_the_next_epoch(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_steps": 7})
    fit(spec)
    assert [r["step"] for r in records(spec, "checkpoint")] == [7, 14]
    assert [(manifest(spec, s)["epoch"], manifest(spec, s)["step_in_epoch"]) for s in (7, 14)] == [(1, 0), (2, 0)]


def test_checkpoints_every_n_epochs_keep_last_and_the_final_state(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 3}, checkpoint={"every_n_epochs": 2, "keep_last": 1})
    fit(spec)
    assert [r["step"] for r in records(spec, "checkpoint")] == [14, 21]  # epoch 2, then the final state
    assert saved_steps(spec) == [21]
    assert (manifest(spec, 21)["epoch"], manifest(spec, 21)["step_in_epoch"]) == (3, 0)


def test_keep_last_prunes_the_oldest(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 1}, checkpoint={"every_n_steps": 2, "keep_last": 2})
    fit(spec)
    assert [r["step"] for r in records(spec, "checkpoint")] == [2, 4, 6, 7]
    assert saved_steps(spec) == [6, 7]


def test_without_checkpointing_nothing_is_saved_but_the_model(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"max_steps": 3})
    result, _ = fit(spec)
    assert not spec.checkpoint_dir.exists() and records(spec, "checkpoint") == []
    assert result.global_step == 3
    assert json.loads((Path(spec.output) / "model.json").read_text())["global_step"] == 3


class Blocked:
    """A callback that puts a file where ``folder`` (a directory) was once training starts: checkpoint.dir, under
    it, passed the probe before training, and the saves then cannot create it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, run: Any) -> None:
        shutil.rmtree(self.folder)
        self.folder.write_text("x")


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_checkpoint_that_cannot_be_written_fails_naming_the_step(tmp_path: Path, background: bool) -> None:
    root = tmp_path / "file" / "ckpt"
    root.mkdir(parents=True)
    spec = make_spec(tmp_path / "out", checkpoint={"every_n_steps": 2, "dir": str(root), "async_save": background})
    job = FakeJob()
    with pytest.raises(TrainingFailure) as info:
        fit(spec, job=job, callbacks=[Blocked(tmp_path / "file")])
    error = info.value
    assert str(error).startswith(f"checkpoint.dir: cannot write the checkpoint of step 2 under {root} (")
    assert str(error).endswith("); no earlier checkpoint exists; free space or choose another checkpoint.dir, "
                               "then resume with --resume auto")
    # written in the background, the failure is known at the next save (step 4), before it is written
    assert len(job.fw.calls.lrs) == (4 if background else 2) and job.be.teardown_calls == 1


def test_async_saves_write_what_sync_saves_write(tmp_path: Path) -> None:
    """Written on a thread while training goes on, each checkpoint holds the state of its own step: the same
    tensors and manifest (but the run id) as a synchronous save; logged and called back once written, in order."""
    specs = {mode: make_spec(tmp_path / mode, **{**RESUMABLE, "checkpoint": {
        "every_n_steps": 2, "keep_last": 10, "async_save": mode == "async"}}) for mode in ("sync", "async")}
    heard: dict[str, list[int]] = {}
    for mode, spec in specs.items():
        job = FakeJob(framework_options={"noise": 0.01})
        result, _ = fit(spec, job=job, callbacks=[Heard(heard.setdefault(mode, []))])
        assert result.global_step == 14
    assert saved_steps(specs["sync"]) == saved_steps(specs["async"]) == [2, 4, 6, 8, 10, 12, 14]
    assert heard["sync"] == heard["async"] == [2, 4, 6, 8, 10, 12, 14]
    assert [r["step"] for r in records(specs["async"], "checkpoint")] == [2, 4, 6, 8, 10, 12, 14]
    for step in saved_steps(specs["sync"]):
        one, two = (spec.checkpoint_dir / ckpt.step_dir_name(step) for spec in specs.values())
        for name in ("model.safetensors", "optimizer.safetensors"):
            assert (one / name).read_bytes() == (two / name).read_bytes(), (step, name)
        drop = {ckpt.RUN_KEY, "spec", "spec_digest", "files",  # the spec differs in async_save, the run in its id
                "manifest_sha256"}  # and so the digest of the whole
        assert {k: v for k, v in manifest(specs["sync"], step).items() if k not in drop} == \
            {k: v for k, v in manifest(specs["async"], step).items() if k not in drop}, step
    assert not list(specs["async"].checkpoint_dir.glob(".tmp-*"))


class Heard:
    """A callback noting the step of every ``on_checkpoint``, and that the checkpoint is complete by then."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def on_checkpoint(self, run: Any, step: int, path: Path) -> None:
        assert (path / "manifest.json").is_file(), path
        self.steps.append(step)


# --------------------------------------------------------------------------- resume


RESUMABLE = {"optimizer": {"lr": 0.05, "momentum": 0.9},
             "schedule": {"warmup_epochs": 0.5, "decay": "step", "step_epochs": 1, "gamma": 0.5},
             "checkpoint": {"every_n_steps": 4}}


@pytest.mark.parametrize("stop_at", [4, 6, 7, 9])
def test_stop_and_resume_equals_a_straight_run_bit_for_bit(tmp_path: Path, stop_at: int) -> None:
    noisy = {"noise": 0.01}  # gradient noise from the framework's RNG: resuming must restore it
    straight = make_spec(tmp_path / "straight", **RESUMABLE)
    _, a = fit(straight, job=FakeJob(framework_options=noisy))

    stopped = make_spec(tmp_path / "resumed", **RESUMABLE, loop={"max_steps": stop_at})
    first, b = fit(stopped, job=FakeJob(framework_options=noisy))
    assert first.global_step == stop_at and saved_steps(stopped)[-1] == stop_at
    saved = manifest(stopped, stop_at)
    assert (saved["epoch"], saved["step_in_epoch"]) == divmod(stop_at, PER_EPOCH)

    resumed = make_spec(tmp_path / "resumed", **RESUMABLE)
    second, c = fit(resumed, job=FakeJob(framework_options=noisy), resume="auto")
    assert c.fw.calls.loaded == c.fw.calls.optimizer_loaded == 1
    assert c.fw.calls.rng_set == [[resumed.seed, stop_at]]  # one draw per micro-step before the stop
    assert [r["step"] for r in records(resumed, "resume")] == [stop_at]

    steps_b, steps_c = [m.step for m in b.fw.calls.micro], [m.step for m in c.fw.calls.micro]
    assert steps_b == list(range(1, stop_at + 1)) and steps_c == list(range(stop_at + 1, 15))
    assert steps_b + steps_c == [m.step for m in a.fw.calls.micro]
    assert sample_ids(stopped, b.fw.calls.micro + c.fw.calls.micro) == sample_ids(straight, a.fw.calls.micro)
    assert b.fw.calls.lrs + c.fw.calls.lrs == a.fw.calls.lrs
    assert second.global_step == 14 and second.epochs_done == 2

    want, got = final_state(straight), final_state(resumed)
    assert sorted(want) == sorted(got)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    assert np.isfinite(want[WEIGHT]).all()


class ForgetfulJob(FakeJob):
    """A framework that ignores the RNG state a checkpoint gives it."""

    def framework_factory(self, spec: TrainSpec, world: World, backend: Any) -> FakeFramework:
        fw = super().framework_factory(spec, world, backend)
        fw.set_rng_state = lambda state: None  # type: ignore[method-assign]
        return fw


def test_without_the_rng_state_the_resumed_run_differs(tmp_path: Path) -> None:
    """The bit-for-bit test above has teeth: a resume that drops the RNG state changes the weights."""
    noisy = {"noise": 0.01}
    straight = make_spec(tmp_path / "straight", **RESUMABLE)
    fit(straight, job=FakeJob(framework_options=noisy))
    fit(make_spec(tmp_path / "resumed", **RESUMABLE, loop={"max_steps": 6}), job=FakeJob(framework_options=noisy))
    resumed = make_spec(tmp_path / "resumed", **RESUMABLE)
    fit(resumed, job=ForgetfulJob(framework_options=noisy), resume="auto")
    assert not np.array_equal(final_state(straight)[WEIGHT], final_state(resumed)[WEIGHT])


def test_resume_auto_without_a_checkpoint_starts_from_scratch(tmp_path: Path,
                                                              shown: io.StringIO) -> None:
    spec = make_spec(tmp_path, loop={"max_steps": 2}, checkpoint={"every_n_steps": 1})
    _, job = fit(spec, resume="auto", show_progress=True)
    assert f"no checkpoint in {spec.checkpoint_dir}: starting from scratch" in shown.getvalue()
    assert [m.step for m in job.fw.calls.micro] == [1, 2] and job.fw.calls.loaded == 0
    assert job.be.broadcast == [None]  # rank 0 found nothing and told the others
    assert records(spec, "resume") == []


def test_an_elastic_restart_resumes_from_the_newest_checkpoint(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLYTRAIN_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    spec = make_spec(tmp_path, checkpoint={"every_n_steps": 2})
    fit(make_spec(tmp_path, loop={"max_steps": 5}, checkpoint={"every_n_steps": 2}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _, job = fit(spec)  # no resume argument: the restart count asks for it
    assert job.fw.calls.micro[0].step == 6
    # without checkpointing a restarted worker starts over, even next to checkpoints
    plain = make_spec(tmp_path)
    assert saved_steps(plain)[-1] == 14
    _, job = fit(plain)
    assert job.fw.calls.micro[0].step == 1 and job.fw.calls.loaded == 0


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its size and modification time (ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_resuming_a_complete_run_says_so_and_writes_nothing(tmp_path: Path, shown: io.StringIO) -> None:
    """Issue 36 item 1: it trained nothing, then wrote an epoch record with a NaN train loss, a checkpoint and a
    TensorBoard event."""
    spec = make_spec(tmp_path, checkpoint={"every_n_epochs": 1, "monitor": "val_loss", "save_top_k": 1})
    first, _ = fit(spec)
    before = files(tmp_path)
    assert {"metrics.jsonl", "model.json", "checkpoints/best/index.json"} <= set(before)
    assert any(name.startswith("tb/") for name in before)
    result, job = fit(spec, resume="auto", show_progress=True)
    assert job.fw.calls.micro == [] and job.fw.calls.evaluated == [] and job.fw.calls.loaded == 1
    assert files(tmp_path) == before  # no record, checkpoint, best index, model or TensorBoard event
    assert shown.getvalue().splitlines()[-1] == (
        f"the run is complete: {spec.checkpoint_dir / 'step-00000014'} is at step 14, and this run ends at step 14 "
        "(loop.epochs: 2); nothing to train (raise loop.epochs or loop.max_steps to train on)")
    assert (result.global_step, result.epochs_done, result.history) == (14, first.epochs_done, [])
    assert job.be.teardown_calls == 1
    # a run that ended between its last checkpoint and its final model gets that model, and nothing else
    for name in ("model.json", "model.safetensors"):
        (tmp_path / name).unlink()
    result, job = fit(spec, resume="auto")
    assert job.fw.calls.micro == [] and job.fw.calls.evaluated
    model = json.loads((tmp_path / "model.json").read_text())
    assert (model["global_step"], model["val_accuracy"]) == (14, pytest.approx(first.val_accuracy))
    assert result.val_accuracy == pytest.approx(first.val_accuracy) and result.history == []
    assert {name: v for name, v in files(tmp_path).items() if "model." not in name} == \
        {name: v for name, v in before.items() if "model." not in name}


def test_a_complete_run_resumed_with_more_epochs_or_steps_trains_the_added_ones(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_epochs": 1})
    fit(spec)
    more = make_spec(tmp_path, loop={"epochs": 3}, checkpoint={"every_n_epochs": 1})
    result, job = fit(more, resume="auto")
    assert sorted({call.step for call in job.fw.calls.micro}) == list(range(15, 22))
    assert [r["epoch"] for r in records(spec, "epoch")] == [0, 1, 2] and saved_steps(spec)[-1] == 21
    assert (result.global_step, result.epochs_done) == (21, 3)
    capped = make_spec(tmp_path / "capped", loop={"max_steps": 5}, checkpoint={"every_n_steps": 5})
    fit(capped)
    _, job = fit(capped, resume="auto")
    assert job.fw.calls.micro == [] and saved_steps(capped) == [5]  # complete at loop.max_steps
    _, job = fit(make_spec(tmp_path / "capped", loop={"max_steps": 9}, checkpoint={"every_n_steps": 5}),
                 resume="auto")
    assert sorted({call.step for call in job.fw.calls.micro}) == [6, 7, 8, 9] and saved_steps(capped) == [5, 9]


def test_resume_refuses_another_model_or_a_mid_epoch_batch_change(tmp_path: Path) -> None:
    fit(make_spec(tmp_path, loop={"max_steps": 3}, checkpoint={"every_n_steps": 3}))
    other_seed = make_spec(tmp_path, seed=4)
    error, job = fit_fails(other_seed, ckpt.CheckpointError, resume="auto")
    assert "was written by a different model/data/seed" in str(error) and job.be.teardown_calls == 1
    assert job.fw.calls.loaded == 0
    smaller = make_spec(tmp_path, data={"batch_size": 6})
    error, job = fit_fails(smaller, ckpt.CheckpointError, resume="auto")
    assert str(error).endswith("stopped mid-epoch with a global batch of 12, this run's is 6; "
                               "set data.global_batch_size=12")


def test_resume_on_another_world_size_keeps_the_position_not_the_rng(tmp_path: Path) -> None:
    fit(make_spec(tmp_path, loop={"max_steps": 7}, checkpoint={"every_n_epochs": 1}), job=FakeJob())
    spec = make_spec(tmp_path, data={"batch_size": 6}, checkpoint={"every_n_epochs": 1})
    _, job = fit(spec, TWO, resume="auto")
    assert job.fw.calls.loaded == 1 and job.fw.calls.rng_set == []  # one rank's RNG cannot seed two
    assert [m.step for m in job.fw.calls.micro] == list(range(8, 15))

"""Callbacks, early stopping and best checkpoints, driven through the Trainer on the fakes (trainer_runs).

80 training samples, batches of 12: 7 steps per epoch. The fake framework's val loss falls epoch by epoch
on this data, which the assertions use (and check).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_runs import PER_EPOCH, fit, fit_fails, make_spec, records

from polytrain.checkpoint import store as ckpt
from polytrain.errors import SpecError
from polytrain.train.callbacks import Callback, RunInfo
from polytrain.train.trainer import Trainer


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_train_start(self, run: RunInfo) -> None:
        self.events.append(("start", run.rank, run.world_size))

    def on_step_end(self, run: RunInfo, step: int, logs: Any) -> None:
        self.events.append(("step", step, dict(logs)))

    def on_validation_end(self, run: RunInfo, epoch: int, logs: Any) -> None:
        self.events.append(("validation", epoch, dict(logs)))

    def on_checkpoint(self, run: RunInfo, step: int, path: Path) -> None:
        self.events.append(("checkpoint", step, path))

    def on_train_end(self, run: RunInfo, result: Any) -> None:
        self.events.append(("end", result.global_step))


def run_with(spec: Any, callbacks: list[Any], resume: str | None = None) -> Any:
    from trainer_fakes import FakeJob

    job = FakeJob()
    trainer = Trainer(spec, show_progress=False, resume=resume, backend_factory=job.backend_factory,
                      framework_factory=job.framework_factory, callbacks=callbacks)
    return trainer.fit(), job


def test_every_hook_is_called_in_order_with_what_it_says(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 2, "log_every_n_steps": 3}, checkpoint={"every_n_epochs": 1})
    recorder = Recorder()
    result, _ = run_with(spec, [recorder])
    kinds = [e[0] for e in recorder.events]
    assert kinds[0] == "start" and kinds[-1] == "end" and recorder.events[0] == ("start", 0, 1)
    steps = [e for e in recorder.events if e[0] == "step"]
    assert [e[1] for e in steps] == list(range(1, 2 * PER_EPOCH + 1))
    with_loss = [e[1] for e in steps if "loss" in e[2]]
    assert with_loss == [3, 6, 7, 9, 12, 14]  # every 3 steps and at each epoch's end
    logged = {r["step"]: r["loss"] for r in records(spec, "step")}
    assert all(e[2]["loss"] == logged[e[1]] for e in steps if "loss" in e[2])
    validations = [e for e in recorder.events if e[0] == "validation"]
    assert [(e[1], e[2]["val_loss"]) for e in validations] == [(r["epoch"], r["val_loss"])
                                                               for r in records(spec, "epoch")]
    checkpoints = [e for e in recorder.events if e[0] == "checkpoint"]
    assert [(e[1], e[2]) for e in checkpoints] == [(7, spec.checkpoint_dir / "step-00000007"),
                                                   (14, spec.checkpoint_dir / "step-00000014")]
    assert all(p.is_dir() for _, _, p in checkpoints)
    assert recorder.events[-1] == ("end", result.global_step) == ("end", 14)


def test_a_callback_named_in_the_spec_is_made_and_called(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_hooks.py").write_text(
        "SEEN = []\n"
        "class Counter:\n"
        "    def on_step_end(self, run, step, logs):\n"
        "        SEEN.append((run.rank, step))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = make_spec(tmp_path / "run", callbacks=["my_hooks:Counter"], loop={"epochs": 1})
    fit(spec)
    assert sys.modules["my_hooks"].SEEN == [(0, s) for s in range(1, PER_EPOCH + 1)]


@pytest.mark.parametrize(("callbacks", "message"), [
    (["no_such_module_here:X"], "callbacks[0]: cannot import module 'no_such_module_here'"),
    (["json:dumps"], "callbacks[0]: json:dumps() raised TypeError"),
    (["collections:OrderedDict"], "callbacks[0]: OrderedDict has none of the hooks on_train_start"),
])
def test_bad_callbacks_are_one_line(tmp_path: Path, callbacks: list[str], message: str) -> None:
    error, _ = fit_fails(make_spec(tmp_path, callbacks=callbacks), SpecError)
    assert str(error).startswith(message) and "\n" not in str(error)


def test_early_stopping_stops_when_the_monitor_stops_improving(tmp_path: Path) -> None:
    # val_loss falls every epoch here, so in mode 'max' only the first validation is an improvement
    spec = make_spec(tmp_path, loop={"epochs": 6, "early_stopping": {"monitor": "val_loss", "mode": "max",
                                                                      "patience": 2}})
    result, job = fit(spec)
    losses = [r["val_loss"] for r in records(spec, "epoch")]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]
    assert result.stopped_early and result.epochs_done == 3 and result.global_step == 3 * PER_EPOCH
    assert records(spec, "early_stopping") == [{**records(spec, "early_stopping")[0], "epoch": 2, "step": 21}]
    assert job.be.broadcast[-1] is True  # rank 0's decision is what every rank acts on
    assert not spec.checkpoint_dir.exists()  # no checkpointing asked for: stopping writes none


def test_early_stopping_in_mode_min_with_min_delta(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 4, "early_stopping": {"monitor": "val_loss", "mode": "min",
                                                                      "patience": 4, "min_delta": 0.0}})
    result, _ = fit(spec)
    assert not result.stopped_early and result.epochs_done == 4  # it kept improving
    spec = make_spec(tmp_path / "b", loop={"epochs": 4, "early_stopping": {"monitor": "val_loss",
                                                                            "patience": 1, "min_delta": 1e6}})
    result, _ = fit(spec)
    assert result.stopped_early and result.epochs_done == 2  # no gain is worth a million


def test_an_early_stopped_run_resumes_as_stopped(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_epochs": 1},
                     loop={"epochs": 6, "early_stopping": {"monitor": "val_loss", "mode": "max", "patience": 1}})
    first, _ = fit(spec)
    assert first.stopped_early and first.global_step == 2 * PER_EPOCH
    metrics = (tmp_path / "metrics.jsonl").read_text()
    again, job = fit(spec, resume="auto")
    assert job.fw.calls.micro == [] and again.global_step == first.global_step  # nothing more to train
    assert again.stopped_early and again.history == [] and job.fw.calls.evaluated == []
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # a complete run writes nothing


def test_best_checkpoints_keep_the_top_k_by_the_monitored_value(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 4}, checkpoint={"monitor": "val_loss", "mode": "max", "save_top_k": 2})
    fit(spec)
    epochs = records(spec, "epoch")
    best_two = sorted(epochs, key=lambda r: r["val_loss"], reverse=True)[:2]
    index = json.loads((spec.checkpoint_dir / "best" / "index.json").read_text())
    assert (index["monitor"], index["mode"]) == ("val_loss", "max")
    assert [(e["step"], e["value"]) for e in index["best"]] == [(r["step"], r["val_loss"]) for r in best_two]
    kept = sorted(p.name for p in ckpt.complete_checkpoints(spec.checkpoint_dir / "best"))
    assert kept == sorted(ckpt.step_dir_name(r["step"]) for r in best_two)
    saved = json.loads((spec.checkpoint_dir / "best" / kept[0] / "manifest.json").read_text())
    assert saved["global_step"] == int(kept[0].removeprefix("step-"))
    assert not ckpt.complete_checkpoints(spec.checkpoint_dir)  # no regular checkpoints were asked for


def test_save_last_leaves_every_validation_resumable(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 3}, checkpoint={"save_last": True, "keep_last": 5})
    fit(spec)
    assert [int(p.name.removeprefix("step-")) for p in ckpt.complete_checkpoints(spec.checkpoint_dir)] == [7, 14, 21]


@pytest.mark.parametrize(("changes", "message"), [
    ({"checkpoint": {"monitor": "val_mae"}},
     "checkpoint.monitor: 'val_mae' is not logged by this run (logged: train_loss, val_accuracy, val_loss)"),
    ({"loop": {"early_stopping": {"monitor": "val_los"}}},
     "loop.early_stopping.monitor: 'val_los' is not logged by this run (logged: train_loss, val_accuracy, "
     "val_loss)"),
])
def test_a_monitor_that_is_not_logged_is_one_line(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    error, job = fit_fails(make_spec(tmp_path, **changes), SpecError)
    assert str(error) == message
    assert job.framework is None  # refused before anything was built


def test_without_validation_data_epochs_end_on_the_train_loss(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, data={"val_fraction": 0.0}, loop={"epochs": 2})
    result, job = fit(spec)
    epochs = records(spec, "epoch")
    assert [(r["val_loss"], r["val_accuracy"]) for r in epochs] == [(None, None)] * 2
    assert all(r["train_loss"] > 0 for r in epochs) and result.epochs_done == 2
    assert job.fw.calls.evaluated == []  # no evaluation pass over an empty set
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest["val_loss"] is None and manifest["val_accuracy"] is None  # not NaN (invalid JSON)


@pytest.mark.parametrize("changes", [{"checkpoint": {"monitor": "val_loss"}},
                                     {"loop": {"early_stopping": {"monitor": "val_accuracy"}}}])
def test_a_validation_monitor_without_validation_data_is_one_line(tmp_path: Path, changes: dict[str, Any]) -> None:
    error, job = fit_fails(make_spec(tmp_path, data={"val_fraction": 0.0}, **changes), SpecError)
    assert "needs validation data and this run has none" in str(error) and "data.val_fraction" in str(error)
    assert job.framework is None


# --------------------------------------------------------------------------- best checkpoints across runs


def best_index(spec: Any) -> dict[str, Any]:
    return json.loads((spec.checkpoint_dir / "best" / "index.json").read_text())


def test_another_runs_best_index_is_not_taken_up_and_its_checkpoints_stay(tmp_path: Path) -> None:
    """Issue 26 item 9: run B (val_accuracy/max) took up run A's index (val_loss/min), mixed both metrics in it
    and deleted A's best checkpoint."""
    import numpy as np

    from polytrain.train.callbacks import BestCheckpoints

    root = tmp_path / "best"
    state = {"model": {"w": np.zeros(3, np.float32)}}
    theirs = ckpt.save_checkpoint(root, 10, state, {ckpt.RUN_KEY: "run-a"})
    index_a = {"monitor": "val_loss", "mode": "min", ckpt.RUN_KEY: "run-a",
               "best": [{"path": theirs.name, "step": 10, "epoch": 0, "value": 0.5}]}
    (root / "index.json").write_text(json.dumps(index_a))
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    best = BestCheckpoints(root, "val_accuracy", "max", 1)
    best.start(ckpt.Owner("run-b"))
    assert best.entries == [] and best.wants(0.1)
    mine = ckpt.save_checkpoint(root, 20, state, {ckpt.RUN_KEY: "run-b"})
    assert best.keep(mine, 20, 1, 0.1) == []
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before  # A's best checkpoint is untouched
    [kept] = root.glob("index-val_loss-min-*.json")
    assert json.loads(kept.read_text()) == index_a
    assert json.loads((root / "index.json").read_text()) == {
        "monitor": "val_accuracy", "mode": "max", ckpt.RUN_KEY: "run-b",
        "best": [{"path": mine.name, "step": 20, "epoch": 1, "value": 0.1}]}
    mine_next = ckpt.save_checkpoint(root, 30, state, {ckpt.RUN_KEY: "run-b"})
    assert best.keep(mine_next, 30, 2, 0.2) == [mine] and not mine.exists() and theirs.is_dir()


def test_a_resumed_run_takes_up_its_index_only_for_the_same_monitor_and_mode(tmp_path: Path) -> None:
    common = {"every_n_steps": PER_EPOCH, "save_top_k": 2}
    first = make_spec(tmp_path, loop={"epochs": 4, "max_steps": 2 * PER_EPOCH},
                      checkpoint={**common, "monitor": "val_loss", "mode": "max"})
    fit(first)
    assert [e["step"] for e in best_index(first)["best"]] == [PER_EPOCH, 2 * PER_EPOCH]  # val loss falls
    same = make_spec(tmp_path, loop={"epochs": 4, "max_steps": 3 * PER_EPOCH},
                     checkpoint={**common, "monitor": "val_loss", "mode": "max"})
    fit(same, resume="auto")  # the same ranking goes on: epoch 3 ranks below the first two
    assert [e["step"] for e in best_index(same)["best"]] == [PER_EPOCH, 2 * PER_EPOCH]
    before = sorted(p.name for p in ckpt.complete_checkpoints(same.checkpoint_dir / "best"))
    other = make_spec(tmp_path, loop={"epochs": 4}, checkpoint={**common, "monitor": "val_loss", "mode": "min"})
    fit(other, resume="auto")
    index = best_index(other)
    assert (index["monitor"], index["mode"]) == ("val_loss", "min")
    assert [e["step"] for e in index["best"]] == [4 * PER_EPOCH]  # only this ranking's validations
    [kept] = (other.checkpoint_dir / "best").glob("index-val_loss-max-*.json")
    assert [e["step"] for e in json.loads(kept.read_text())["best"]] == [PER_EPOCH, 2 * PER_EPOCH]
    after = sorted(p.name for p in ckpt.complete_checkpoints(other.checkpoint_dir / "best"))
    assert set(before) <= set(after)  # the max ranking's checkpoints were not removed

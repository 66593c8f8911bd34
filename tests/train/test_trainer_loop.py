"""The Trainer's loop (polytrain/train/trainer.py), on the fakes (tests/trainer_runs.py): which samples each step takes,
the loss scale, accumulation, the learning rate of every step, where a run stops, non-finite steps, the step and
epoch records, what rank 0 and the others show, the timeline."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from trainer_fakes import BIAS, WEIGHT, FakeJob
from trainer_runs import (
    N_TRAIN,
    N_VAL,
    PER_EPOCH,
    STEP_SIZES,
    TWO,
    by_step,
    epoch_order,
    final_state,
    fit,
    fit_fails,
    make_spec,
    manifest,
    records,
    sample_ids,
)

from polytrain.checkpoint import store as ckpt
from polytrain.data import load_dataset
from polytrain.errors import TrainingFailure
from polytrain.train.schedule import lr_at
from polytrain.world import World

# --------------------------------------------------------------------------- exact averaging


def test_loss_scale_sync_and_every_sample_once_per_epoch(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    result, job = fit(spec)
    calls = job.fw.calls.micro
    assert [c.step for c in calls] == list(range(1, 15))
    assert [c.count for c in calls] == STEP_SIZES * 2
    assert [c.loss_scale for c in calls] == [1 / 12] * 6 + [1 / 8] + [1 / 12] * 6 + [1 / 8]
    assert all(c.sync for c in calls)
    ids = sample_ids(spec, calls)
    for epoch in range(2):
        seen = ids[epoch * N_TRAIN:(epoch + 1) * N_TRAIN]
        assert sorted(seen) == list(range(N_TRAIN))  # every sample once
        assert seen == epoch_order(spec, epoch).tolist()
    assert ids[:N_TRAIN] != ids[N_TRAIN:]
    assert result.global_step == 14 and result.epochs_done == 2
    assert job.fw.calls.lr_steps == list(range(1, 15))


def test_grad_accumulation_splits_each_step_into_micro_batches(tmp_path: Path) -> None:
    spec = make_spec(tmp_path / "accum", data={"batch_size": 4}, loop={"grad_accum_steps": 3})
    _, job = fit(spec)
    steps = by_step(job.fw.calls.micro)
    assert sorted(steps) == list(range(1, 15))
    for step, calls in steps.items():
        last = step % PER_EPOCH == 0
        assert [c.count for c in calls] == ([3, 3, 2] if last else [4, 4, 4])
        assert [c.sync for c in calls] == [False, False, True]  # synchronise only on the last micro-step
        assert [c.loss_scale for c in calls] == [1 / (8 if last else 12)] * 3  # over the step, not the micro-batch
    ids = sample_ids(spec, job.fw.calls.micro)
    assert ids == epoch_order(spec, 0).tolist() + epoch_order(spec, 1).tolist()
    assert len(job.fw.calls.lrs) == 14  # one update per step, not per micro-step

    # 3 micro-steps of 4 make the same updates as one step of 12
    whole = make_spec(tmp_path / "whole")
    fit(whole)
    accumulated, single = final_state(spec), final_state(whole)
    for name in (WEIGHT, BIAS):
        np.testing.assert_allclose(accumulated[name], single[name], rtol=1e-5, atol=1e-6)
    losses = [r["loss"] for r in records(spec, "step")]
    assert losses == pytest.approx([r["loss"] for r in records(whole, "step")], rel=1e-5)


def test_two_simulated_ranks_take_their_half_of_each_step(tmp_path: Path) -> None:
    """World(rank=0, size=2) with peers that hold the same numbers (all_reduce doubles sums)."""
    spec = make_spec(tmp_path, data={"batch_size": 6}, schedule={"lr_scaling": "linear"}, loop={"epochs": 1})
    result, job = fit(spec, TWO)
    calls = job.fw.calls.micro
    assert [c.count for c in calls] == [6] * 6 + [4]
    assert [c.loss_scale for c in calls] == [2 / 12] * 6 + [2 / 8]  # world size / samples in the step
    order = epoch_order(spec, 0)
    expected = [i for k, size in enumerate(STEP_SIZES) for i in order[k * 12:k * 12 + size // 2]]
    assert sample_ids(spec, calls) == expected  # rank 0's half of every step
    assert job.fw.calls.lrs == [0.1] * 7  # lr × world size
    # the window's sums are all-reduced: doubled loss over doubled count is rank 0's mean
    (record,) = records(spec, "step")
    assert record["step"] == 7
    assert record["loss"] == pytest.approx(sum(c.loss_sum for c in calls) / 40, rel=1e-12)
    # rank 0 evaluates its 10 of the 20 validation samples, in ceil(10 / 6) = 2 batches
    assert job.fw.calls.evaluated == [5, 5]
    model = json.loads((Path(spec.output) / "model.json").read_text())
    assert model["world_size"] == 2 and len(model["rank_state_digests"]) == 2
    assert model["rank_state_digests"][0] == model["rank_state_digests"][1] == ckpt.state_digest(final_state(spec))
    assert result.global_step == 7


# --------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize("max_steps", [None, 10])
def test_lr_of_every_step_is_the_schedule(tmp_path: Path, max_steps: int | None) -> None:
    spec = make_spec(tmp_path, data={"batch_size": 6}, optimizer={"lr": 0.1},
                     schedule={"lr_scaling": "sqrt", "warmup_epochs": 1, "decay": "cosine", "min_lr": 0.001},
                     loop={"epochs": 3, "max_steps": max_steps, "grad_clip_norm": 0.5})
    _, job = fit(spec, TWO)
    total = 21 if max_steps is None else 10
    # the horizon is every step of loop.epochs; max_steps only stops early (issue 16 item 13)
    expected = [lr_at(k, optimizer=spec.optimizer, schedule=spec.schedule, world_size=2, steps_per_epoch=7,
                      total_steps=21) for k in range(total)]
    assert job.fw.calls.lrs == expected
    assert job.fw.calls.lr_steps == list(range(1, total + 1))
    peak = 0.1 * math.sqrt(2)
    assert job.fw.calls.lrs[0] == pytest.approx(peak / 7)  # warm-up over the first epoch's 7 steps
    assert job.fw.calls.lrs[6] == pytest.approx(peak)
    span = 21 - 7
    assert job.fw.calls.lrs[-1] == pytest.approx(0.001 + (peak - 0.001) * 0.5 * (1 + math.cos(math.pi * (total - 8) / span)))
    assert job.fw.calls.clip_norms == [0.5] * total
    assert [r["lr"] for r in records(spec, "step")] == [expected[r["step"] - 1] for r in records(spec, "step")]


def test_stopping_at_max_steps_and_resuming_without_it_is_the_straight_run(tmp_path: Path) -> None:
    """With decay cosine: the learning rates and the final weights of a run stopped at max_steps and
    resumed without it are those of the run that never stopped (issue 16 item 13)."""
    common = {"data": {"batch_size": 6}, "optimizer": {"lr": 0.1},
              "schedule": {"warmup_epochs": 1, "decay": "cosine", "min_lr": 0.001}}
    straight = make_spec(tmp_path / "straight", loop={"epochs": 3}, **common)
    _, whole = fit(straight)
    stopped = make_spec(tmp_path / "parts", loop={"epochs": 3, "max_steps": 10},
                        checkpoint={"every_n_epochs": 1}, **common)
    _, first = fit(stopped)
    _, rest = fit(make_spec(tmp_path / "parts", loop={"epochs": 3}, checkpoint={"every_n_epochs": 1}, **common),
                  resume="auto")
    assert len(first.fw.calls.lrs) == 10 and rest.fw.calls.lr_steps[0] == 11
    assert first.fw.calls.lrs + rest.fw.calls.lrs == whole.fw.calls.lrs
    assert ckpt.state_digest(final_state(stopped)) == ckpt.state_digest(final_state(straight))


# --------------------------------------------------------------------------- early exits


def test_max_steps_mid_epoch_evaluates_the_partial_epoch_and_leaves_it_resumable(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 3, "max_steps": 10}, checkpoint={"every_n_epochs": 1})
    result, job = fit(spec)
    assert result.global_step == 10 and result.epochs_done == 1  # epoch 2 is not complete
    assert [(h["epoch"], h["step"]) for h in result.history] == [(0, 7), (1, 10)]
    assert job.fw.calls.evaluated == [10, 10, 10, 10]  # 2 batches at each of the 2 epoch ends
    assert [r["step"] for r in records(spec, "step")] == [7, 10]
    assert [r["step"] for r in records(spec, "checkpoint")] == [7, 10]
    assert (manifest(spec, 10)["epoch"], manifest(spec, 10)["step_in_epoch"]) == (1, 3)
    assert manifest(spec, 10)["samples_in_epoch"] == 36
    model = json.loads((Path(spec.output) / "model.json").read_text())
    assert (model["global_step"], model["epochs"]) == (10, 1)
    assert model["val_accuracy"] == pytest.approx(result.val_accuracy)

    rest = make_spec(tmp_path, loop={"epochs": 3}, checkpoint={"every_n_epochs": 1})
    _, job = fit(rest, resume="auto")
    assert [m.step for m in job.fw.calls.micro] == list(range(11, 22))
    assert sample_ids(rest, job.fw.calls.micro[:1]) == epoch_order(rest, 1)[36:48].tolist()


def test_max_steps_on_an_epoch_boundary_runs_no_empty_epoch(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 3, "max_steps": 7})
    result, job = fit(spec)
    assert result.global_step == 7 and result.epochs_done == 1
    assert [r["epoch"] for r in records(spec, "epoch")] == [0]
    assert job.fw.calls.evaluated == [10, 10]


# --------------------------------------------------------------------------- non-finite gradients


def test_nonfinite_stop_fails_naming_the_step(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    error, job = fit_fails(spec, TrainingFailure, job=FakeJob(framework_options={"nonfinite_steps": {3}}))
    assert str(error) == ("step 3: the loss or a gradient is NaN/Inf; stopped (reliability.on_nonfinite: stop; "
                          "'skip' drops such steps instead)")
    assert job.fw.calls.lr_steps == [1, 2] and job.fw.calls.discarded == 0
    assert [(r["step"], r["action"]) for r in records(spec, "nonfinite")] == [(3, "stop")]
    assert job.be.teardown_calls == 1 and not (Path(spec.output) / "model.safetensors").exists()


def test_nonfinite_skip_drops_the_update_and_counts_the_step(tmp_path: Path,
                                                              shown: io.StringIO) -> None:
    spec = make_spec(tmp_path, reliability={"on_nonfinite": "skip"})
    result, job = fit(spec, job=FakeJob(framework_options={"nonfinite_steps": {3, 5}}), show_progress=True)
    assert job.fw.calls.discarded == 2 and job.fw.calls.grads_finite == 14
    assert job.fw.calls.lr_steps == [1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert result.global_step == 14 and result.epochs_done == 2
    assert [(r["step"], r["action"]) for r in records(spec, "nonfinite")] == [(3, "skip"), (5, "skip")]
    assert all(np.isfinite(v).all() for v in final_state(spec).values())  # the NaN never reached the weights
    err = shown.getvalue()
    assert "step 3: the loss or a gradient is NaN/Inf; step skipped (on_nonfinite: skip)" in err
    assert "step 5: the loss or a gradient is NaN/Inf; step skipped (on_nonfinite: skip)" in err


def test_fp16_leaves_nonfinite_steps_to_its_loss_scaler(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, precision="fp16", loop={"epochs": 1})
    _, job = fit(spec, job=FakeJob(framework_options={"nonfinite_steps": {7}}))
    assert job.fw.calls.grads_finite == 0 and job.fw.calls.lr_steps == list(range(1, 8))
    assert records(spec, "nonfinite") == []


# --------------------------------------------------------------------------- the log window


def test_step_records_average_the_window_since_the_last_record(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, data={"batch_size": 6}, loop={"grad_accum_steps": 2, "log_every_n_steps": 3})
    result, job = fit(spec, job=FakeJob(framework_options={"stats": {"loss_scale": 1024.0}}))
    steps = records(spec, "step")
    assert [(r["step"], r["epoch"]) for r in steps] == [(3, 0), (6, 0), (7, 0), (9, 1), (12, 1), (14, 1)]
    calls = job.fw.calls.micro
    start = 0
    for r in steps:
        window = [c for c in calls if start < c.step <= r["step"]]
        assert len(window) == 2 * (r["step"] - start)
        assert r["loss"] == pytest.approx(sum(c.loss_sum for c in window) / sum(c.count for c in window), rel=1e-12)
        assert r["lr"] == job.fw.calls.lrs[r["step"] - 1]
        assert r["loss_scale"] == 1024.0  # the framework's step_stats ride along
        start = r["step"]
    epochs = records(spec, "epoch")
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 7), (1, 14)]
    assert [e["train_loss"] for e in epochs] == [steps[2]["loss"], steps[5]["loss"]]
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]  # it learns
    assert result.train_loss == steps[-1]["loss"]


def test_validation_numbers_and_model_json_come_from_the_final_weights(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, loop={"epochs": 3})
    result, job = fit(spec)
    data = load_dataset(spec.data, spec.seed)
    state = final_state(spec)
    out = data.x_val @ state[WEIGHT].T + state[BIAS]
    shifted = out - out.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert result.val_accuracy == pytest.approx(float((out.argmax(axis=1) == data.y_val).mean()))
    assert result.val_loss == pytest.approx(float(-log_prob[np.arange(N_VAL), data.y_val].mean()), rel=1e-5)
    assert 0.5 < result.val_accuracy < 1.0  # learned, on data that is not trivially separable
    first, last = result.history[0]["val_loss"], result.history[-1]["val_loss"]
    assert last < first
    model = json.loads((Path(spec.output) / "model.json").read_text())
    assert (model["global_step"], model["epochs"], model["backend"], model["world_size"]) == (21, 3, "fake", 1)
    assert model["rank_state_digests"] == [ckpt.state_digest(state)]
    assert model["spec_digest"] == spec.digest() and model["model_digest"] == spec.model_digest()


def test_the_result_holds_plain_python_numbers(tmp_path: Path) -> None:
    """Issue 36 item 4: a printed result read ``np.float64(0.0297…)``."""
    result, _ = fit(make_spec(tmp_path, loop={"epochs": 2}))
    assert "np." not in repr(result) and "numpy" not in repr(result)
    floats = [result.train_loss, result.val_loss, result.val_accuracy, result.samples_per_s,
              *result.val_metrics.values(), *(r[k] for r in result.history for k in ("train_loss", "val_loss"))]
    ints = [result.global_step, result.epochs_done, *(r[k] for r in result.history for k in ("epoch", "step"))]
    assert len(result.history) == 2 and {type(v) for v in floats} == {float} and {type(v) for v in ints} == {int}


def test_a_regression_task_reports_no_accuracy(tmp_path: Path, shown: io.StringIO) -> None:
    spec = make_spec(tmp_path, data={"synthetic": {"task": "regression", "noise": 0.1}}, loop={"epochs": 1})
    result, _ = fit(spec, show_progress=True)
    assert result.val_accuracy is None and records(spec, "epoch")[0]["val_accuracy"] is None
    assert f"validation loss: {result.val_loss:.6f}" in shown.getvalue()


# --------------------------------------------------------------------------- what rank 0 and the others show


def test_startup_lines_and_the_rendezvous_record(tmp_path: Path, shown: io.StringIO) -> None:
    spec = make_spec(tmp_path, loop={"max_steps": 1})
    fit(spec, job=FakeJob(backend_options={"listen": "127.0.0.1:29555"}), show_progress=True)
    err = shown.getvalue().splitlines()
    assert err[:2] == ["polytrain: rendezvous listens on 127.0.0.1:29555",
                       "polytrain: torch/fake-label on 1 process(es) (launcher: single); 80 training samples, "
                       "20 validation samples"]
    assert [r["listen"] for r in records(spec, "rendezvous")] == ["127.0.0.1:29555"]


def test_another_rank_writes_nothing_and_speaks_only_when_verbose(tmp_path: Path,
                                                                  shown: io.StringIO) -> None:
    spec = make_spec(tmp_path / "out", loop={"max_steps": 2}, checkpoint={"every_n_steps": 1})
    rank1 = World(rank=1, size=2, local_rank=1, local_size=2, launcher="torchrun")
    _, job = fit(spec, rank1, show_progress=True)
    assert shown.getvalue() == ""
    assert not Path(spec.output).exists()  # no metrics, checkpoints or model from rank 1
    assert len(job.be.gathered) > 0  # ... yet it took part in every gather
    _, job = fit(spec, rank1, show_progress=True, verbose=True)
    lines = shown.getvalue().splitlines()
    assert lines and all(line.startswith("[rank 1] ") for line in lines)
    assert not Path(spec.output).exists()


def test_the_timeline_records_every_micro_step_and_update(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, data={"batch_size": 6}, loop={"grad_accum_steps": 2})
    trace_path = tmp_path / "trace.json"
    _, job = fit(spec, timeline=str(trace_path))
    assert job.be.barrier_calls == 1  # one barrier to line up the ranks' clocks
    trace = json.loads(trace_path.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = [e["name"] for e in events]
    assert names.count("micro-step") == len(job.fw.calls.micro) == 28
    assert names.count("optimizer step") == 14 and names.count("evaluation") == 2
    micro = [e["args"] for e in events if e["name"] == "micro-step"]
    assert [(a["step"], a["micro"], a["samples"]) for a in micro[12:14]] == [(7, 0, 4), (7, 1, 4)]
    assert trace["otherData"] == {"framework": "torch", "backend": "fake", "world_size": 1, "launcher": "single"}

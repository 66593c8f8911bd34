"""The Trainer's own logic, in-process, on a fake backend and a numpy framework (tests/trainer_fakes.py).

The data: 100 synthetic samples, 20 held out, so 80 training samples; a batch of 12 gives 7 steps per
epoch, the last of 8 samples. Every test asserts numbers the Trainer decides: which samples, which loss
scale, which learning rate, which checkpoint, which record, which message.
"""

from __future__ import annotations

import copy
import io
import json
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from trainer_fakes import BIAS, WEIGHT, FakeFramework, FakeJob, FrozenPeerBoard, MicroCall

from polytrain import checkpoint as ckpt
from polytrain import trainer as trainer_mod
from polytrain.data import load_dataset
from polytrain.errors import SpecError, TrainingFailure
from polytrain.metrics import Progress
from polytrain.schedule import lr_at
from polytrain.spec import TrainSpec, from_dict
from polytrain.trainer import Trainer, TrainResult
from polytrain.world import World

N_TRAIN, N_VAL, BATCH, PER_EPOCH = 80, 20, 12, 7
STEP_SIZES = [12] * 6 + [8]  # samples in each step of an epoch

BASE: dict[str, Any] = {
    "framework": "torch",
    "backend": "local",
    "model": {"name": "mlp", "params": {"hidden_sizes": [4]}},
    "data": {"name": "synthetic", "batch_size": BATCH, "val_fraction": 0.2,
             "synthetic": {"samples": 100, "features": 6, "classes": 3, "noise": 1.5}},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "loop": {"epochs": 2},
    "seed": 3,
}

ONE, TWO = World(), World(rank=0, size=2, local_size=2, launcher="torchrun")


def _merge(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def make_spec(output: Path, **changes: Any) -> TrainSpec:
    """BASE with ``changes`` merged table by table, writing into ``output``."""
    return from_dict(_merge(BASE, {"output": str(output), **changes}))


def fit(spec: TrainSpec, world: World = ONE, *, job: FakeJob | None = None, resume: str | None = None,
        timeline: str | None = None, show_progress: bool = False, verbose: bool = False) -> tuple[TrainResult, FakeJob]:
    job = job or FakeJob()
    trainer = Trainer(spec, world, show_progress=show_progress, resume=resume, timeline=timeline, verbose=verbose,
                      backend_factory=job.backend_factory, framework_factory=job.framework_factory)
    return trainer.fit(), job


def fit_fails(spec: TrainSpec, error: type[BaseException], world: World = ONE,
              job: FakeJob | None = None, resume: str | None = None) -> tuple[BaseException, FakeJob]:
    job = job or FakeJob()
    with pytest.raises(error) as info:
        fit(spec, world, job=job, resume=resume)
    return info.value, job


def records(spec: TrainSpec, event: str) -> list[dict[str, Any]]:
    path = Path(spec.output) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


def sample_ids(spec: TrainSpec, calls: list[MicroCall]) -> list[int]:
    """The training-set index of every sample the micro-steps got, in order."""
    x_train = load_dataset(spec.data, spec.seed).x_train
    where = {row.tobytes(): i for i, row in enumerate(x_train)}
    assert len(where) == len(x_train) == N_TRAIN
    return [where[row.tobytes()] for call in calls for row in call.x]


def by_step(calls: list[MicroCall]) -> dict[int, list[MicroCall]]:
    out: dict[int, list[MicroCall]] = {}
    for call in calls:
        out.setdefault(call.step, []).append(call)
    return out


def saved_steps(spec: TrainSpec) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in ckpt.complete_checkpoints(spec.checkpoint_dir)]


def manifest(spec: TrainSpec, step: int) -> dict[str, Any]:
    return json.loads((spec.checkpoint_dir / ckpt.step_dir_name(step) / "manifest.json").read_text())


def final_state(spec: TrainSpec) -> dict[str, np.ndarray]:
    return load_file(str(Path(spec.output) / "model.safetensors"))


def epoch_order(spec: TrainSpec, epoch: int) -> np.ndarray:
    """The README's rule: each epoch's order is a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([spec.seed, epoch]).permutation(N_TRAIN)


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What the Trainer prints (its Progress binds sys.stderr at import, out of capsys' reach)."""
    stream = io.StringIO()

    def progress(enabled: bool, prefix: str = "") -> Progress:
        return Progress(enabled=enabled, stream=stream, prefix=prefix)

    monkeypatch.setattr(trainer_mod, "Progress", progress)
    return stream


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


def test_a_checkpoint_that_cannot_be_written_fails_naming_the_step(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "ckpt"
    spec = make_spec(tmp_path / "out", checkpoint={"every_n_steps": 2, "dir": str(root)})
    error, job = fit_fails(spec, TrainingFailure)
    assert str(error).startswith(f"checkpoint.dir: cannot write the checkpoint of step 2 under {root} (")
    assert str(error).endswith("); no earlier checkpoint exists; free space or choose another checkpoint.dir, "
                               "then resume with --resume auto")
    assert len(job.fw.calls.lrs) == 2 and job.be.teardown_calls == 1


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


def test_resuming_a_finished_run_keeps_its_validation_numbers(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint={"every_n_epochs": 1})
    first, _ = fit(spec)
    _, job = fit(spec, resume="auto")
    assert job.fw.calls.micro == []  # nothing left to train
    model = json.loads((Path(spec.output) / "model.json").read_text())
    assert (model["global_step"], model["val_accuracy"]) == (14, pytest.approx(first.val_accuracy))


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


def test_a_regression_task_reports_no_accuracy(tmp_path: Path, shown: io.StringIO) -> None:
    spec = make_spec(tmp_path, data={"synthetic": {"task": "regression", "noise": 0.1}}, loop={"epochs": 1})
    result, _ = fit(spec, show_progress=True)
    assert result.val_accuracy is None and records(spec, "epoch")[0]["val_accuracy"] is None
    assert f"validation loss: {result.val_loss:.6f}" in shown.getvalue()


# --------------------------------------------------------------------------- ranks that disagree


def _drifting(after: int, bad_ranks: tuple[int, ...], size: int) -> Any:
    """all_gather_object whose weight digests differ on ``bad_ranks`` from the ``after``-th digest gather on."""
    seen = [0]

    def gather(obj: Any) -> list[Any]:
        if isinstance(obj, str) and len(obj) == 32:  # a state digest
            seen[0] += 1
            if seen[0] >= after:
                return [("0" * 32 if r in bad_ranks else obj) for r in range(size)]
        return [obj] * size

    return gather


@pytest.mark.parametrize("size,bad,named", [(2, (1,), "1"), (3, (2,), "2"), (3, (1, 2), "1, 2")])
def test_verify_every_n_steps_names_the_ranks_whose_weights_drifted(tmp_path: Path, size: int,
                                                                    bad: tuple[int, ...], named: str) -> None:
    spec = make_spec(tmp_path, reliability={"verify_every_n_steps": 2})
    job = FakeJob(backend_options={"gather": _drifting(2, bad, size)})
    error, job = fit_fails(spec, TrainingFailure, World(rank=0, size=size, local_size=size), job=job)
    assert str(error) == (f"step 4: the weights of rank(s) {named} differ from rank 0's (replicas drifted apart; "
                          f"reliability.verify_every_n_steps)")
    assert job.fw.calls.lr_steps == [1, 2, 3, 4] and job.be.teardown_calls == 1


def test_verify_every_n_steps_checks_at_its_cadence(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, data={"batch_size": 6}, reliability={"verify_every_n_steps": 3})
    _, job = fit(spec, TWO)
    digests = [g for g in job.be.gathered if isinstance(g, str)]
    assert len(digests) == 14 // 3 + 1  # steps 3, 6, 9, 12 and the final model's digests
    assert digests[-1] == ckpt.state_digest(final_state(spec))


def _disagreeing(key: str, theirs: str) -> Any:
    def gather(obj: Any) -> list[Any]:
        if isinstance(obj, dict) and key in obj:
            return [obj, {**obj, key: theirs}]
        return [obj, obj]

    return gather


def test_startup_check_refuses_a_rank_with_another_spec_before_building(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    job = FakeJob(backend_options={"gather": _disagreeing("spec digest", "0123abcd")})
    error, job = fit_fails(spec, TrainingFailure, TWO, job=job)
    assert str(error) == (f"startup check: rank 1's spec digest (0123abcd) differs from rank 0's ({spec.digest()}); "
                          f"every rank must run the same spec, code and libraries")
    assert not job.fw.built and job.fw.calls.micro == [] and job.be.teardown_calls == 1


def test_startup_check_compares_parameter_shapes_after_building(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    job = FakeJob(backend_options={"gather": _disagreeing("parameters", "beefbeefbeefbeef")})
    error, job = fit_fails(spec, TrainingFailure, TWO, job=job)
    mine = next(g["parameters"] for g in job.be.gathered if isinstance(g, dict) and "parameters" in g)
    assert str(error).startswith(f"startup check: rank 1's parameters (beefbeefbeefbeef) differs from rank 0's ({mine})")
    assert job.fw.built and job.fw.calls.micro == []


@pytest.mark.parametrize("world,check", [(ONE, True), (TWO, False)])
def test_no_startup_check_on_one_process_or_when_switched_off(tmp_path: Path, world: World, check: bool) -> None:
    spec = make_spec(tmp_path, loop={"max_steps": 1}, reliability={"startup_check": check})
    _, job = fit(spec, world, job=FakeJob(backend_options={"gather": _disagreeing("spec digest", "x")}))
    assert [g for g in job.be.gathered if isinstance(g, dict)] == []


# --------------------------------------------------------------------------- failures and teardown


@pytest.mark.parametrize("fail_at,log_every,activity", [
    (3, 10, "forward/backward of step 3"),  # the 3rd gradient all-reduce
    (2, 1, "the optimizer step of step 1"),  # step 1's log window
    (9, 10, "evaluation"),  # 7 gradient reductions, the epoch's log window, then the evaluation's sums
])
def test_a_peer_failure_in_the_loop_names_what_the_rank_was_doing(tmp_path: Path, fail_at: int, log_every: int,
                                                                   activity: str) -> None:
    spec = make_spec(tmp_path, loop={"log_every_n_steps": log_every})
    error, job = fit_fails(spec, TrainingFailure, job=FakeJob(backend_options={"fail_reduce_at": fail_at}))
    assert str(error) == (f"rank 0: a collective failed during {activity}: another rank died, stalled or lost its "
                          f"connection ([gloo] Connection reset by peer)")
    assert isinstance(error.__cause__, RuntimeError)
    assert job.be.teardown_calls == 1


def test_a_peer_failure_names_the_rank_whose_heartbeat_stopped(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, reliability={"stall_warning_s": 0.2})
    board = FrozenPeerBoard("forward/backward of step 2")
    job = FakeJob(backend_options={"fail_reduce_at": 3, "board": board})
    error, job = fit_fails(spec, TrainingFailure, TWO, job=job)
    assert str(error) == ("rank 0: a collective failed during forward/backward of step 3: rank 1 stopped responding "
                          "(last seen in forward/backward of step 2) ([gloo] Connection reset by peer)")
    assert 0 in board.posted  # this rank's watchdog published its progress there
    assert not any(t.name == "polytrain-stall-watchdog" and t.is_alive() for t in threading.enumerate())


def test_other_errors_in_the_loop_pass_through_unchanged_after_teardown(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    failure = ValueError("shapes (12,6) and (5,3) not aligned")
    error, job = fit_fails(spec, ValueError, TWO, job=FakeJob(backend_options={"fail_reduce_at": 2,
                                                                                "failure": failure}))
    assert error is failure and job.be.teardown_calls == 1
    assert not any(t.name == "polytrain-stall-watchdog" and t.is_alive() for t in threading.enumerate())


def test_teardown_runs_when_building_the_model_fails(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    failure = RuntimeError("no such layer")
    error, job = fit_fails(spec, RuntimeError, job=FakeJob(framework_options={"build_error": failure}))
    assert error is failure
    assert (job.be.setup_calls, job.be.teardown_calls) == (1, 1)
    assert (Path(spec.output) / "metrics.jsonl").read_text() == ""


def test_an_unwritable_output_is_a_spec_error_naming_output(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "run"
    error, job = fit_fails(make_spec(target), SpecError)
    assert str(error).startswith(f"output: cannot write to {target} (")
    assert str(error).endswith("); choose a writable directory") and "\n" not in str(error)
    assert job.framework is None  # nothing was built or trained


def test_an_unwritable_output_still_tears_the_backend_down(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _, job = fit_fails(make_spec(tmp_path / "file" / "run"), SpecError)
    assert job.be.teardown_calls == 1


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

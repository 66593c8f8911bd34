"""How `Trainer.fit` ends, on the fakes of tests/trainer_fakes.py: the trained model it hands back, and a teardown
that releases the model before the backend goes, runs every step whatever fails, and never hides the run's own
error. (Real process groups and threads: tests/multiproc/test_clean_exit.py.)"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from trainer_fakes import FakeFramework, FakeJob, FrozenPeerBoard
from trainer_runs import TWO, fit, fit_fails, make_spec


def watchdog_alive() -> bool:
    return any(t.name.startswith("polytrain") and t.is_alive() for t in threading.enumerate())


def test_fit_hands_back_the_trained_weights_released_before_the_backend_is_torn_down(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    result, job = fit(spec)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(result.model) == sorted(saved)
    assert all(np.array_equal(result.model[name], saved[name]) for name in saved)
    assert job.fw.released and job.fw.released_after_teardown is False
    assert job.be.teardown_calls == 1


def test_a_failed_run_still_releases_the_model_stops_the_watchdog_and_tears_down(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, reliability={"stall_warning_s": 0.2})
    failure = ValueError("shapes (12,6) and (5,3) not aligned")
    job = FakeJob(backend_options={"fail_reduce_at": 2, "failure": failure, "board": FrozenPeerBoard("start-up")})
    error, job = fit_fails(spec, ValueError, TWO, job=job)
    assert error is failure
    assert job.fw.released and job.fw.released_after_teardown is False and job.be.teardown_calls == 1
    assert not watchdog_alive()


def test_a_failing_teardown_step_does_not_skip_the_others_and_is_raised_after_a_good_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def release(self: FakeFramework, state: object = None) -> None:
        calls.append(state is not None)
        if len(calls) > 1:  # the teardown's own call, after the run handed its model back
            raise OSError("cannot free the model")

    monkeypatch.setattr(FakeFramework, "release", release)
    spec = make_spec(tmp_path, loop={"epochs": 1})
    job = FakeJob()
    with pytest.raises(OSError, match="cannot free the model"):
        fit(spec, job=job)
    assert calls == [True, False] and job.be.teardown_calls == 1  # the backend went too


def test_a_failing_teardown_step_never_replaces_the_runs_own_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def release(self: FakeFramework, state: object = None) -> None:
        raise OSError("cannot free the model")

    monkeypatch.setattr(FakeFramework, "release", release)
    failure = RuntimeError("no such layer")
    error, job = fit_fails(make_spec(tmp_path), RuntimeError, job=FakeJob(framework_options={"build_error": failure}))
    assert error is failure and job.be.teardown_calls == 1

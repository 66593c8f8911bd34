"""What the Trainer checks and makes of failures (polytrain/errors.py, polytrain/comm/settle.py, polytrain/comm/agree.py), on the fakes (tests/trainer_runs.py):
ranks whose weights drift or whose spec or model differs, a peer lost mid-collective named with what this rank was
doing, errors passed through after teardown, an unwritable output. (How fit ends: test_trainer_teardown.py.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from trainer_fakes import FakeJob, FrozenPeerBoard
from trainer_runs import ONE, TWO, final_state, fit, fit_fails, make_spec

from polytrain.checkpoint import store as ckpt
from polytrain.errors import SpecError, TrainingFailure
from polytrain.world import World

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
    assert len(digests) == 14 // 3  # steps 3, 6, 9 and 12
    # the final model's digest goes with each rank's peak memory (model.json's rank_peak_memory)
    final = [g for g in job.be.gathered if isinstance(g, tuple)]
    assert len(final) == 1 and final[0][0] == ckpt.state_digest(final_state(spec))


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
    assert not (Path(spec.output) / "metrics.jsonl").exists()  # nothing was logged, so no log was made


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

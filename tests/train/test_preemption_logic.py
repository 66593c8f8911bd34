"""The stop's own logic (polytrain.train.preemption): the agreed step from the reduced count, the handlers put
back, the refusal outside the main thread, and what the requeue does under Slurm (``scontrol`` stood in for: the
real signals and launchers are tests/multiproc/test_preemption.py's)."""

from __future__ import annotations

import signal
import subprocess
import threading

import pytest

from polytrain.errors import SpecError
from polytrain.spec.preemption import PreemptionSpec, check_requeue
from polytrain.train.preemption import NO_STOP, StepStop, request_requeue


def test_every_rank_stops_after_the_window_whose_count_was_not_zero() -> None:
    stop = StepStop(PreemptionSpec(), rank=1)
    stop.heard(0.0, 4)
    assert not stop.due(4) and not stop.due(5)
    stop.heard(1.0, 8)
    stop.heard(2.0, 12)  # a later window changes nothing
    assert not stop.due(7) and stop.due(8) and stop.stopped_at == 8
    assert not NO_STOP.due(10**9) and NO_STOP.asked == 0.0


def test_a_signal_is_noted_once_and_the_handlers_are_put_back() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    stop = StepStop(PreemptionSpec(signals=("SIGUSR2",), grace_s=3600), rank=0).install()
    try:
        assert stop.asked == 0.0
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR2)  # a second one during the stop: nothing more
        assert stop.signal == "SIGUSR2" and stop.asked == 1.0
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR2) is before


def test_after_a_stop_the_handler_stays_till_the_exit_and_a_late_signal_changes_nothing() -> None:
    """Under torchrun the first rank to exit 75 makes the agent SIGTERM the others while they tear down: they must
    still end with 75, not die of the signal (found by 5 loaded rounds of tests/multiproc/test_preemption.py). Once
    closed the signal is ignored, not handled: Python's finalisation puts SIG_DFL back for its own handlers (an
    own-loop rank died -15 so), not for SIG_IGN."""
    before = signal.getsignal(signal.SIGUSR2)
    exits: list[int] = []
    stop = StepStop(PreemptionSpec(signals=("SIGUSR2",), grace_s=3600), rank=1, exit_now=exits.append).install()
    try:
        stop.heard(1.0, 8)  # another rank's signal
        assert stop.due(8)
        signal.raise_signal(signal.SIGUSR2)  # the agent's, before the teardown
        assert stop.signal == "SIGUSR2" and exits == []
        stop.close()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR2)  # during the teardown: this process lives on
        assert exits == []
    finally:
        stop.stopped_at = None
        stop.close()
    assert signal.getsignal(signal.SIGUSR2) is before


def test_outside_the_main_thread_the_signals_stay_as_they_were_and_a_line_says_so() -> None:
    lines: list[str] = []
    before = signal.getsignal(signal.SIGUSR2)
    thread = threading.Thread(target=lambda: StepStop(PreemptionSpec(signals=("SIGUSR2",)), 0,
                                                      emit=lines.append).install())
    thread.start()
    thread.join()
    assert lines == ["polytrain: preemption: signals are handled only when training runs in the main thread"]
    assert signal.getsignal(signal.SIGUSR2) is before


def test_requeue_always_needs_slurm() -> None:
    with pytest.raises(SpecError, match="preemption.requeue: 'always' needs a scheduler that requeues"):
        check_requeue(PreemptionSpec(requeue="always"), {})
    check_requeue(PreemptionSpec(requeue="always"), {"SLURM_JOB_ID": "7"})
    check_requeue(PreemptionSpec(), {})


def test_the_requeue_asks_slurm_where_it_can_and_says_what_happens_where_it_cannot() -> None:
    calls: list[list[str]] = []

    def scontrol(code: int, err: str = ""):
        def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, code, "", err)
        return run

    slurm = {"SLURM_JOB_ID": "42"}
    found = lambda name: f"/usr/bin/{name}"  # noqa: E731
    assert request_requeue("auto", {}, found, scontrol(0)) == ""  # not under Slurm
    assert request_requeue("never", slurm, found, scontrol(0)) == ""
    assert request_requeue("auto", slurm, found, scontrol(0)) == "; Slurm job 42 requeued"
    assert calls == [["/usr/bin/scontrol", "requeue", "42"]]
    assert request_requeue("always", slurm, found, scontrol(1, "Requested operation is presently disabled\n")) == \
        "; scontrol requeue 42 failed: Requested operation is presently disabled"
    assert request_requeue("auto", slurm, found, scontrol(1, "Job is pending execution for job 42\n")) == \
        "; Slurm job 42 was requeued already"  # scontrol requeue's SIGTERM: the scheduler requeued it first
    assert request_requeue("auto", slurm, lambda name: None, scontrol(0)) == (
        "; scontrol is not reachable here (a container?): Slurm requeues the job on exit code 75 where RequeueExit "
        "names it")

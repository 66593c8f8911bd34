"""How `polytrain launch` passes a stop on (launchers/stopping.py): a preemptible spec's grace, and SIGTERM passed to
Open MPI's mpirun as a signal it forwards without ending the ranks."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from polytrain.launchers.processes import GRACE_SECONDS, supervise
from polytrain.launchers.stopping import MARGIN_S, stop_policy

TRAIN = (sys.executable, "-m", "polytrain.cli", "train")


def spec(tmp_path: Path, **table: object) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"framework": "torch", "preemption": table}))
    return str(path)


def test_a_script_or_a_spec_without_the_table_keeps_the_usual_grace(tmp_path: Path) -> None:
    (tmp_path / "plain.json").write_text("{}")
    for program in ((sys.executable, "loop.py"), (*TRAIN, str(tmp_path / "plain.json")), (*TRAIN, "elsewhere.yaml")):
        policy = stop_policy(program, term_ends_ranks=True)
        assert (policy.grace, dict(policy.forward_as)) == (GRACE_SECONDS, {})


def test_a_preemptible_spec_gets_its_grace_and_sigterm_reaches_mpiruns_ranks_as_sigusr1(tmp_path: Path) -> None:
    program = (*TRAIN, spec(tmp_path))
    policy = stop_policy(program, term_ends_ranks=True)
    assert policy.grace == 120.0 + MARGIN_S and dict(policy.forward_as) == {signal.SIGTERM: signal.SIGUSR1}
    assert dict(stop_policy(program, term_ends_ranks=False).forward_as) == {}  # torchrun, srun: SIGTERM as it is
    shorter = stop_policy((*program, "--set", "preemption.grace_s=30", "--set=preemption.signals=[TERM,USR2]"), True)
    assert shorter.grace == 30.0 + MARGIN_S and dict(shorter.forward_as) == {signal.SIGTERM: signal.SIGUSR2}


def test_a_table_without_a_forwarded_signal_is_said_at_the_start(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    policy = stop_policy((*TRAIN, spec(tmp_path, signals=["SIGTERM"])), term_ends_ranks=True)
    assert dict(policy.forward_as) == {}
    assert "handles neither SIGUSR1 nor SIGUSR2" in capsys.readouterr().err
    assert stop_policy((*TRAIN, spec(tmp_path, grace_s="soon")), True).grace == GRACE_SECONDS  # refused by the ranks


@pytest.mark.timeout(60)
def test_a_sigterm_to_the_supervisor_reaches_the_worker_as_the_signal_mapped() -> None:
    """A real worker signals its supervisor (this process) with SIGTERM; it gets SIGUSR1, stops on it with 75."""
    worker = ("import os, signal, sys\n"
              "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))\n"
              "os.kill(os.getppid(), signal.SIGTERM)\n"
              "while True: signal.pause()\n")
    mapped = supervise([[sys.executable, "-c", worker]], [{}], forward_as={signal.SIGTERM: signal.SIGUSR1})
    assert (mapped.code, mapped.signal) == (75, signal.SIGTERM)
    plain = supervise([[sys.executable, "-c", worker]], [{}])
    assert (plain.code, plain.signal) == (15, signal.SIGTERM)

"""Faults injected into real 2-rank runs: NaN losses, ranks that disagree, a rank that dies.

Each asserts how the job ends (exit codes, the one line, no process left); how long that takes is
measured by bench/fault_timing.py.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from procs import check, free_port, loopback_env, read_metrics, run

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "polytrain.cli"]


def launch_local(tmp_path: Path, sets: list[str], **env: str):
    spec = tmp_path / "spec.yaml"
    spec.write_text("framework: torch\n")
    args = [a for s in sets for a in ("--set", s)]
    return run([*CLI, "launch", "--launcher", "local", "-np", "2", str(spec), "--quiet", *args],
               env=loopback_env(PYTHONPATH=str(HERE), **env))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_on_one_rank_is_seen_by_all(tmp_path: Path, policy: str) -> None:
    out = tmp_path / "out"
    result = launch_local(tmp_path, ["model.name=nan_model:make", "loop.epochs=2", f"output={out}",
                                     "optimizer.lr=0.1", "optimizer.momentum=0.9",
                                     f"reliability.on_nonfinite={policy}"], NAN_RANK="1", NAN_AT="5")
    if policy == "stop":
        assert result.returncode != 0
        lines = [line for line in result.stderr.splitlines() if line.startswith("polytrain: error: ")]
        assert len(lines) == 2, result.stderr  # both ranks stop, each with one line naming the step
        assert all(line.startswith("polytrain: error: step 5: the loss or a gradient is NaN/Inf") for line in lines)
        assert "Traceback" not in result.stderr
    else:
        check(result)
        assert [e["step"] for e in read_metrics(out, "nonfinite")] == [5]
        state, manifest = read_model(out)
        assert len(set(manifest["rank_state_digests"])) == 1
        assert all(bool((abs(v) < 1e6).all()) for v in state.values())  # no NaN reached the weights
        assert manifest["val_accuracy"] > 0.5


def test_ranks_with_different_specs_fail_at_startup_on_every_rank(tmp_path: Path) -> None:
    """Two ranks started by hand (torchrun-style variables) with different learning rates: each fails
    (exit 1) with the startup check's line naming rank 1, and neither trains."""
    commands = []
    for rank, lr in ((0, "0.1"), (1, "0.2")):
        args = [*CLI, "train", "--quiet", "--set", f"optimizer.lr={lr}", "--set", f"output={tmp_path / str(rank)}"]
        commands.append(f"RANK={rank} LOCAL_RANK={rank} {shlex.join(args)} 2>{tmp_path / f'rank{rank}.err'}")
    env = loopback_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()))
    result = run(["sh", "-c", f"{commands[0]} & p0=$!; {commands[1]} & p1=$!; wait $p0; echo rank0 exit $?; "
                               f"wait $p1; echo rank1 exit $?"], env=env, timeout=120)
    assert re.findall(r"rank\d exit \d+", result.stdout) == ["rank0 exit 1", "rank1 exit 1"], result.stdout
    for rank in (0, 1):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert err.strip().splitlines()[-1].startswith("polytrain: error: startup check: rank 1's spec digest"), err
        assert "Traceback" not in err
        assert not (tmp_path / str(rank) / "model.json").exists()
    assert result.left_behind == []


def test_a_dead_rank_fails_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed mid-step: the launcher names it, exits non-zero, and no worker outlives it."""
    result = launch_local(tmp_path, ["model.name=faulty_model:make", "loop.epochs=2", f"output={tmp_path / 'o'}"],
                          FAULT_RANK="1", FAULT_AT="7")
    assert result.returncode != 0
    assert "polytrain launch: rank 1 was killed by SIGKILL; stopping the other 1 worker(s)" in result.stderr
    assert not (tmp_path / "o" / "model.json").exists()
    assert result.left_behind == []

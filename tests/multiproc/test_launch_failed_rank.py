"""`polytrain launch` names the rank that failed — under the local starter, torchrun, mpirun and deepspeed.

Real 2-rank runs in which rank 1 fails: SIGKILLed mid-step (``faulty_model``) or raising its own error,
in ``polytrain train`` workers (which write the exit board) and in plain scripts (where only the
launcher's own output says who failed). Each run must exit non-zero, say which rank failed and how in
one ``polytrain launch:`` line, keep torchrun's ``ChildFailedError`` traceback out of stderr unless
``--debug``, and leave no process behind (``procs.run``'s ``left_behind``: what still ran when it exited).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import Finished, loopback_env, run

from polytrain.launchers import find_binary

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "polytrain.cli"]
FAULT_VARIABLES = ("PYTHONPATH", "FAULT_RANK", "FAULT_AT", "FAULT_MODE")
KILLED = re.compile(r"^polytrain launch: rank 1 (on host \S+ )?was killed by SIGKILL;", re.MULTILINE)
RAISED = re.compile(r"^polytrain launch: rank 1 on host \S+ exited with code 1 \(RuntimeError: injected failure "
                    r"on rank 1\); (torchrun|mpirun) exited with code [1-9]\d*$", re.MULTILINE)

# Rank 1 dies only once rank 0 is up (a file rank 0 makes after its line): else, on a loaded machine, rank 1 could
# die before rank 0 had started, and the launcher stop rank 0 before it printed its line.
KILL_RANK_1 = """\
import os, signal, time
rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
up = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank-0-up")
print(f"rank {rank} up", flush=True)
if rank == "0":
    open(up, "w").close()
if rank == "1":
    deadline = time.monotonic() + 120
    while not os.path.exists(up) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
signal.pause()  # until the launcher stops this rank
"""


def launch(args: list[str], **env: str) -> Finished:
    """``polytrain launch ARGS``; ``left_behind`` lists the processes still running when it exited."""
    return run([*CLI, "launch", *args], env=loopback_env(PYTHONPATH=str(HERE), **env), timeout=240)


def launch_spec(tmp_path: Path, launcher: str, *flags: str, **env: str):
    spec = tmp_path / "spec.yaml"
    spec.write_text("framework: torch\n")
    exports = [a for name in FAULT_VARIABLES for a in ("-x", name)]
    sets = ["model.name=faulty_model:make", "loop.epochs=1", f"output={tmp_path / 'out'}"]
    return launch(["--launcher", launcher, "-np", "2", *flags, *exports, str(spec), "--quiet",
                   *[a for s in sets for a in ("--set", s)]], **env)


def need(binary: str) -> None:
    if find_binary(binary) is None:
        pytest.skip(f"{binary} is not installed")


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("polytrain launch:")]


@pytest.mark.parametrize("launcher", ["local", "torchrun", "mpirun",
                                      pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_a_killed_rank_is_named(tmp_path: Path, launcher: str) -> None:
    if launcher != "local":
        need(launcher)
    result = launch_spec(tmp_path, launcher, FAULT_RANK="1", FAULT_AT="7", FAULT_MODE="kill")
    assert result.returncode != 0
    lines = failure_lines(result.stderr)
    assert len(lines) == 1 and KILLED.match(lines[0]), result.stderr[-4000:]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert result.left_behind == []


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_a_rank_that_raises_is_named_with_its_error(tmp_path: Path, launcher: str) -> None:
    need(launcher)
    result = launch_spec(tmp_path, launcher, FAULT_RANK="1", FAULT_AT="7", FAULT_MODE="raise")
    assert result.returncode != 0
    assert RAISED.search(result.stderr), result.stderr[-4000:]
    assert len(failure_lines(result.stderr)) == 1
    assert "ChildFailedError" not in result.stderr
    assert result.left_behind == []


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_a_plain_script_is_named_from_the_launchers_output(tmp_path: Path, launcher: str) -> None:
    """No exit board here (the workers are not polytrain's): what the launcher printed names rank 1."""
    need(launcher)
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1)
    result = launch(["--launcher", launcher, "-np", "2", str(script)])
    assert result.returncode != 0
    lines = failure_lines(result.stderr)
    assert len(lines) == 1 and KILLED.match(lines[0]), result.stderr[-4000:]
    assert f"{launcher} exited with code" in lines[0]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr
    assert "rank 0 up" in result.stdout and "rank 1 up" in result.stdout  # the workers' output passed through
    assert result.left_behind == []


def test_debug_shows_torchruns_own_traceback(tmp_path: Path) -> None:
    need("torchrun")
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1)
    result = launch(["--launcher", "torchrun", "--debug", "-np", "2", str(script)])
    assert result.returncode != 0
    assert "Traceback (most recent call last):" in result.stderr and "ChildFailedError" in result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr
    assert KILLED.search(result.stderr), result.stderr[-4000:]
    assert result.left_behind == []

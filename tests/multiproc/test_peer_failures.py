"""A rank that dies or fails alone: the others end promptly, with one line that says what happened.

- A rank SIGKILLed mid-step while its peer waits in a collective (ranks started by hand, with
  torchrun-style variables, so no launcher kills the survivor for us): the survivor exits 1 with
  ``polytrain: error: rank 0: a collective failed during ...`` as its last line — on PyTorch/DDP
  (gloo) and on TensorFlow/tf-multiworker (gRPC collectives).
- Under mpirun a rank that raises while the other waits in ``MPI_Allreduce``: polytrain aborts the
  MPI job instead of leaving the peer waiting forever.

Each test asserts what ended the job (the exit codes, the named rank, the one line) and that no process
of it is left; how long that takes after the fault is measured by bench/fault_timing.py.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from procs import BIN, free_port, loopback_env, run

from polytrain.horovod.common import _import_error

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
SURVIVOR_LINE = re.compile(r"polytrain: error: rank 0: a collective failed during (forward|backward|forward/backward|gradient allreduce) "
                           r"of step 7: ")
#: What the survivor says about the lost rank: its heartbeat stopped — in the rendezvous store on torch, in
#: the store rank 0 hosts for the watchdog on TensorFlow. Its last heartbeat is up to a second old.
LOST = {"torch-ddp": "rank 1 stopped responding (last seen in ",
        "torch-tensor2": "rank 1 stopped responding (last seen in ",
        "tensorflow-tf-multiworker": "rank 1 stopped responding (last seen in "}

CASES = {
    "torch-ddp": ["framework=torch", "backend=ddp", "model.name=faulty_model:make"],
    # tensor parallel: the survivor waits in a collective of the tensor-parallel group (its own process group)
    "torch-tensor2": ["framework=torch", "backend=ddp", "model.name=tp_user_model:make_faulty", "parallel.tensor=2",
                      "parallel.tensor_plan=tp_user_model:plan"],
    "tensorflow-tf-multiworker": ["framework=tensorflow", "backend=tf-multiworker", "model.name=faulty_keras:make"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_survivor_of_a_killed_peer_fails_in_one_line(tmp_path: Path, case: str) -> None:
    if case.startswith("tensorflow"):
        pytest.importorskip("tensorflow")
    sets = [*CASES[case], "reliability.collective_timeout_s=30", "loop.epochs=1"]
    commands = []
    for rank in (0, 1):
        args = [sys.executable, "-m", "polytrain.cli", "train", "--quiet",
                *[a for s in [*sets, f"output={tmp_path / str(rank)}"] for a in ("--set", s)]]
        commands.append(f"RANK={rank} LOCAL_RANK={rank} {shlex.join(args)} 2>{tmp_path / f'rank{rank}.err'}")
    env = loopback_env(PYTHONPATH=str(HERE), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()),
                       FAULT_RANK="1", FAULT_AT="7", FAULT_MODE="kill")
    result = run(["sh", "-c", f"{commands[0]} & p0=$!; {commands[1]} & p1=$!; wait $p0; echo rank0 exit $?; "
                               f"wait $p1; echo rank1 exit $?"], env=env, timeout=240)
    survivor = (tmp_path / "rank0.err").read_text()
    last = survivor.strip().splitlines()[-1]
    assert SURVIVOR_LINE.match(last) and LOST[case] in last, survivor[-3000:]
    assert "Traceback" not in survivor
    # the survivor failed (exit 1, a TrainingFailure), the killed rank died of SIGKILL (sh: 128 + 9)
    assert re.findall(r"rank\d exit \d+", result.stdout) == ["rank0 exit 1", "rank1 exit 137"], result.stdout
    assert result.left_behind == []


def test_a_rank_that_raises_under_mpirun_ends_the_job(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("mpi4py")
    sets = ["framework=tensorflow", "backend=mpi", "model.name=faulty_keras:make", "loop.epochs=1",
            f"output={tmp_path}"]
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "FAULT_RANK", "-x", "FAULT_AT", "-x",
           "FAULT_MODE", "-x", "PYTHONPATH", sys.executable, "-m", "polytrain.cli", "train", "--quiet",
           *[a for s in sets for a in ("--set", s)]]
    result = run(cmd, env=loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT="7", FAULT_MODE="raise"),
                 timeout=240)
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in result.stderr, result.stderr[-3000:]
    # rank 0 sat in MPI_Allreduce, which has no timeout: only the abort can have ended it (else run() times out)
    assert "MPI_ABORT was invoked on rank 1" in result.stdout + result.stderr
    assert result.left_behind == []


def stalled_run(tmp_path: Path, sleep_s: str, sets: list[str]):
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "polytrain.cli", "train", "--quiet",
           *[a for s in ["model.name=faulty_model:make", "loop.epochs=1", f"output={tmp_path}", *sets]
             for a in ("--set", s)]]
    env = loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT="5", FAULT_MODE="sleep", FAULT_SLEEP=sleep_s)
    return run(cmd, env=env, timeout=240)


def test_a_stalled_rank_is_named_by_the_waiting_rank_and_the_run_goes_on(tmp_path: Path) -> None:
    """Rank 1 sleeps 6 s in the forward pass of step 5; after 2 s rank 0, waiting in backward's allreduce,
    warns naming rank 1 and where it is. The run then finishes normally."""
    result = stalled_run(tmp_path, "6", ["reliability.stall_warning_s=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "WARNING: no progress" in line]
    named = [line for line in warnings if re.search(
        r"rank 0: WARNING: no progress in backward of step 5 for \d+ s; rank 1 is still in forward of step 5 "
        r"\(the job fails after reliability.collective_timeout_s=300 s\)", line)]
    assert len(named) == 1, warnings  # once per stalled activity (a loaded machine may add others)
    assert json.loads((tmp_path / "model.json").read_text())["global_step"] == 23


@pytest.mark.parametrize("framework,backend", [("torch", "mpi"), ("tensorflow", "mpi"),
                                               ("tensorflow", "tf-multiworker"), ("tensorflow", "horovod")])
def test_under_mpirun_a_stalled_rank_is_named_too(tmp_path: Path, framework: str, backend: str) -> None:
    """The mpi backend and TensorFlow's have no store of their own: the ranks post their progress in
    one rank 0 hosts for the watchdog, so rank 0, inside the gradient allreduce (MPI's, the
    strategy's or Horovod's), still names the rank that is behind."""
    pytest.importorskip("mpi4py")
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    if backend == "horovod" and _import_error("horovod.tensorflow") is not None:
        pytest.skip("Horovod's TensorFlow ops are not built here")
    model = "faulty_model:make" if framework == "torch" else "faulty_keras:make"
    sets = [f"framework={framework}", f"backend={backend}", f"model.name={model}", "loop.epochs=1", "loop.max_steps=8",
            f"output={tmp_path}", "reliability.stall_warning_s=2"]  # 8 steps: the stall is at step 5
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", *[a for v in ("FAULT_RANK", "FAULT_AT", "FAULT_MODE",
           "FAULT_SLEEP", "PYTHONPATH") for a in ("-x", v)], sys.executable, "-m", "polytrain.cli", "train", "--quiet",
           *[a for s in sets for a in ("--set", s)]]
    env = loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT="5", FAULT_MODE="sleep", FAULT_SLEEP="5")
    env.pop("MASTER_ADDR")
    result = run(cmd, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() + result.stderr.splitlines()
                if "WARNING: no progress" in line]
    assert any(re.search(r"rank 0: WARNING: no progress in (backward|gradient allreduce) of step 5 for \d+ s; "
                         r"rank 1 is still in forward(/backward)? of step 5", line) for line in warnings), warnings


def test_a_rank_stalled_past_the_collective_timeout_fails_the_job_in_one_line(tmp_path: Path) -> None:
    """Rank 1 sleeps 120 s; the 6 s collective timeout fails rank 0 (not the end of the sleep: then the run
    would finish normally), and torchrun stops the sleeper."""
    result = stalled_run(tmp_path, "120", ["reliability.stall_warning_s=1", "reliability.collective_timeout_s=6"])
    assert result.returncode != 0
    assert "rank 0: WARNING: no progress in backward of step 5" in result.stderr
    assert re.search(r"polytrain: error: rank 0: a collective failed during backward of step 5: another rank died, "
                     r"stalled or lost its connection", result.stderr), result.stderr[-3000:]
    assert not (tmp_path / "model.json").exists()
    assert result.left_behind == []


RAISERS = {
    "launch": lambda port: [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2",
                            "--master-port", str(port)],
    "torchrun": lambda port: [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1",
                              f"--master_port={port}", "-m", "polytrain.cli", "train"],
    "mpirun": lambda port: [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "FAULT_RANK", "-x", "FAULT_AT",
                            "-x", "FAULT_MODE", "-x", "PYTHONPATH", sys.executable, "-m", "polytrain.cli", "train"],
}


@pytest.mark.parametrize("launcher", list(RAISERS))
def test_an_exception_on_one_rank_is_reported_once_with_its_traceback(tmp_path: Path, launcher: str) -> None:
    """A bug on rank 1 (an exception in its forward): the job ends non-zero, and stderr holds rank 1's
    traceback exactly once — not a copy from the other rank, which only waited for it."""
    if launcher == "mpirun":
        pytest.importorskip("mpi4py")
    sets = ["model.name=faulty_model:make", "loop.epochs=1", "reliability.collective_timeout_s=30",
            f"output={tmp_path / 'out'}"]
    spec_args = [a for s in sets for a in ("--set", s)]
    cmd = [*RAISERS[launcher](free_port()), *spec_args]
    if launcher == "launch":  # polytrain launch takes a spec file, then polytrain train's arguments
        spec = tmp_path / "spec.yaml"
        spec.write_text("model:\n  name: faulty_model:make\n")
        cmd = [*RAISERS[launcher](free_port()), str(spec), *spec_args]
    env = loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT="7", FAULT_MODE="raise")
    if launcher == "mpirun":
        env.pop("MASTER_ADDR")
    result = run(cmd, env=env, timeout=240)
    err = result.stderr
    assert result.returncode != 0
    # the exception's own line, once (the launcher's summary line may quote it too)
    raised = re.findall(r"^(?:\[rank1\]: )?RuntimeError: injected failure on rank 1$", err, re.MULTILINE)
    assert len(raised) == 1, err[-4000:]
    assert 'polytrain/train/trainer.py", line' in err, err[-4000:]  # the whole traceback, through the trainer
    rank0_traceback = [line for line in err.splitlines() if line.startswith("[rank0]:")]
    assert not rank0_traceback, err[-4000:]
    frames = err.count('faulty_model.py", line')
    assert frames == 1, err[-4000:]  # the raising frame, once: no second copy of the traceback
    assert result.left_behind == []

"""Launching and reading the runs of ``test_workloads.py``: how each job starts (`Job`), several Trainer runs in
one launch (`run_plan`: ``resume_worker.py``; `run_fit`: an ``examples/fit`` script first, ``workload_worker.py``),
and what a run wrote (`Run`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from procs import REPO, check, command, job_env, read_metrics, run

from polytrain.checkpoint.store import read_model

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "resume_worker.py")
SCRIPT_WORKER = str(HERE / "workload_worker.py")
FIT_SCRIPTS = {"torch": REPO / "examples" / "fit" / "train_torch.py",
               "tensorflow": REPO / "examples" / "fit" / "train_tensorflow.py"}

# ------------------------------------------------------------------------------ launching


@dataclass(frozen=True)
class Job:
    """How a run is started: ``python`` (one process), ``torchrun``, ``mpirun``, or ``polytrain launch`` with
    its ``--launcher`` torchrun or local (``launch-torchrun``, ``launch-local``); 2 ranks unless ``python``."""

    launcher: str
    sets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return next(s.partition("=")[2] for s in self.sets if s.startswith("backend="))

    @property
    def launch(self) -> dict[str, Any]:
        """How procs.train and procs.command start it: loopback only, one thread per rank, and this folder
        importable (the user loss, the dataset factory); under mpirun the ranks agree on a master through MPI."""
        mpirun = self.launcher == "mpirun"
        env = {"PYTHONPATH": str(HERE), "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", **self.env,
               **({"MASTER_ADDR": None} if mpirun else {})}
        return {"launcher": self.launcher, "nproc": 1 if self.launcher == "python" else 2, "env": env,
                "exports": ("PYTHONPATH", *self.env) if mpirun else ()}

    def command(self, program: list[str]) -> tuple[list[str], dict[str, str]]:
        """The command line that starts ``program`` (a script and its arguments) this way, and its environment."""
        launch = self.launch
        return (command(self.launcher, program, launch["nproc"], exports=launch["exports"]), job_env(launch["env"]))


def run_plan(job: Job, runs: list[dict[str, Any]], timeout: float = 240) -> None:
    """Several Trainer runs in one launch of ``resume_worker.py``."""
    cmd, variables = job.command([WORKER, json.dumps({"runs": runs})])
    check(run(cmd, env=variables, timeout=timeout))


@dataclass
class Fit:
    """What an ``examples/fit`` script wrote (``out``) and its launch printed."""

    out: Path
    stdout: str


def run_fit(job: Job, framework: str, out: Path, runs: tuple[dict[str, Any], ...] = (), timeout: float = 300) -> Fit:
    """The ``examples/fit`` script of ``framework`` into ``out`` in a launch of its own, then (in the same
    launch, ``workload_worker.py``) the Trainer runs ``runs``."""
    script = str(FIT_SCRIPTS[framework])
    program = [SCRIPT_WORKER, script, str(out), json.dumps({"runs": list(runs)})] if runs else [script, str(out)]
    cmd, variables = job.command(program)
    return Fit(out, check(run(cmd, env=variables, timeout=timeout)).stdout)


# ------------------------------------------------------------------------------ reading runs


@dataclass
class Run:
    out: Path
    events: list[dict[str, Any]]
    state: dict[str, np.ndarray]
    manifest: dict[str, Any]

    @classmethod
    def read(cls, out: Path) -> Run:
        state, manifest = read_model(out)
        return cls(out, read_metrics(out), state, manifest)

    @property
    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    @property
    def accuracy(self) -> float:
        return float(self.manifest["val_accuracy"])


def relative(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def weight_difference(state: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest difference of any tensor, relative to that tensor's largest magnitude."""
    assert set(state) == set(ref)
    return max(float(np.max(np.abs(state[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref)


def assert_bit_identical(run_: Run, straight: Run) -> None:
    assert set(run_.state) == set(straight.state)
    for key, value in straight.state.items():
        assert run_.state[key].dtype == value.dtype and np.array_equal(run_.state[key], value), key
    assert run_.manifest["rank_state_digests"] == straight.manifest["rank_state_digests"]
    assert run_.manifest["global_step"] == straight.manifest["global_step"]

"""Preemption (issue 52): a real signal stops the run at a step every rank agrees on, its checkpoint written there,
exit code 75; ``--resume auto`` then ends on exactly the weights of a run that was never interrupted.

The signal comes from a callback (signal_at.py) at the end of a chosen step: to one rank of two (what a node-local
agent sends; under torchrun and mpirun), to every rank (under torchrun and mpirun), or to torchrun's agent, which passes it on to every rank
(what Kubernetes sends a pod), or to `polytrain launch` above Open MPI's mpirun (which would end its ranks on a
SIGTERM: they get SIGUSR1, see launchers/stopping.py); and to a single process (SIGUSR1, Slurm's ``--signal``). The ranks agree on the first logging window that
closes after it (every ``loop.log_every_n_steps``: 4 here, and at each epoch's end), so the stop step is known in
advance except where the launcher passes the signal on: there it is the last step the run logged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from procs import check, read_metrics, train

from polytrain.checkpoint.store import read_model

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

HERE = Path(__file__).parent
SPEC = {"framework": "torch", "model": {"name": "mlp", "params": {"hidden_sizes": [8]}},
        "loop": {"epochs": 5, "log_every_n_steps": 4},
        "data": {"name": "synthetic", "batch_size": 12, "val_fraction": 0.2,
                 "synthetic": {"samples": 400, "features": 6, "classes": 3, "noise": 1.5}},
        "callbacks": ["signal_at:SignalAt"], "preemption": {}}
PREEMPTED = 75

#: the launchers and backends: (launcher, ranks, backend)
JOBS = {"torchrun": ("torchrun", 2, "ddp"), "mpirun": ("mpirun", 2, "mpi"), "python": ("python", 1, "local"),
        "launch-mpirun": ("launch-mpirun", 2, "mpi")}
#: jobs whose uninterrupted run is another's: the same ranks and backend
SAME_RUN = {"launch-mpirun": "mpirun"}
#: case: (job, signal name, SIGNAL_AT, SIGNAL_RANKS, SIGNAL_TARGET)
CASES = {
    "one rank of two, signalled twice": ("torchrun", "SIGTERM", "5,6", "1", "self"),
    "every rank, at an epoch's end": ("torchrun", "SIGTERM", "11", "all", "self"),
    "torchrun's agent": ("torchrun", "SIGTERM", "5", "0", "parent"),
    "one rank of two under mpirun": ("mpirun", "SIGTERM", "5", "1", "self"),
    "every rank under mpirun": ("mpirun", "SIGTERM", "6", "all", "self"),
    "polytrain launch above mpirun": ("launch-mpirun", "SIGTERM", "5", "0", "launch"),
    "one process, SIGUSR1": ("python", "SIGUSR1", "5", "0", "self"),
}


def spec_file(tmp: Path, signal_name: str | None, **loop: int) -> Path:
    """The spec, its preemption table handling ``signal_name`` (None: the table's default signals)."""
    path = tmp / "spec.json"
    spec = json.loads(json.dumps(SPEC))
    spec["preemption"] = {"signals": [signal_name]} if signal_name else {}
    spec["loop"].update(loop)
    path.write_text(json.dumps(spec))
    return path


def job(out: Path, spec: Path, name: str, resume: bool = False, **signal: str):
    launcher, nproc, backend = JOBS[name]
    return train(out, [f"backend={backend}"], spec=spec, nproc=nproc, launcher=launcher,
                 resume="auto" if resume else None, env={"PYTHONPATH": str(HERE), **signal},
                 exports=["PYTHONPATH", *signal], timeout=240)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[int]]]:
    """The run never interrupted, per job: its weights and the steps its logging windows closed at."""
    runs: dict[str, tuple[dict, list[int]]] = {}
    for name in (name for name in JOBS if name not in SAME_RUN):
        tmp = tmp_path_factory.mktemp(f"uninterrupted-{name}")
        done = job(tmp / "out", spec_file(tmp, "SIGTERM"), name)
        check(done)
        assert not done.left_behind, done.left_behind
        runs[name] = (read_model(tmp / "out")[0], [r["step"] for r in read_metrics(tmp / "out", "step")])
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_stops_every_rank_at_one_step_and_the_resumed_run_ends_on_the_uninterrupted_weights(
        uninterrupted: dict, tmp_path: Path, case: str) -> None:
    launcher, name, at, ranks, target = CASES[case]
    out, spec = tmp_path / "out", spec_file(tmp_path, None if target == "launch" else name)
    stopped = job(out, spec, launcher, SIGNAL_AT=at, SIGNAL_RANKS=ranks, SIGNAL_TARGET=target, SIGNAL_NAME=name)
    assert not stopped.left_behind, stopped.left_behind
    text = stopped.stdout + stopped.stderr
    if launcher != "torchrun":  # one process, or mpirun (and polytrain launch) passing on its ranks' code
        assert stopped.returncode == PREEMPTED, text[-3000:]
    elif target == "parent":  # torchrun ends on the signal itself, after its ranks, without their codes
        assert stopped.returncode != 0 and "got signal: 15" in text, text[-3000:]
    else:  # torchrun reports each rank's code (the first again as the root cause) and fails itself
        codes = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (\d+)", text)
        assert stopped.returncode != 0 and set(codes) == {("0", str(PREEMPTED)), ("1", str(PREEMPTED))}, text[-3000:]
    found = re.search(r"polytrain: preempted by (\w+[ \w]*): every rank stopped after step (\d+), its checkpoint "
                      r"written at step (\d+); resume with --resume auto", text)
    assert found, text[-3000:]
    step = int(found.group(2))
    assert int(found.group(3)) == step
    weights, closes = uninterrupted[SAME_RUN.get(launcher, launcher)]
    first = int(at.split(",")[0])
    if target == "self":  # the first logging window closing after the signal
        assert step == min(c for c in closes if c > first), (step, closes)
    logged = [r["step"] for r in read_metrics(out, "step")]
    assert logged[-1] == step and logged == [c for c in closes if c <= step], (logged, step)  # nothing past it
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == [f"step-{step:08d}"], saved
    assert not (out / "model.safetensors").exists()  # not a finished run

    resumed = job(out, spec, launcher, resume=True)
    check(resumed)
    assert not resumed.left_behind, resumed.left_behind
    assert [r["step"] for r in read_metrics(out, "resume")] == [step]
    got, _ = read_model(out)
    assert sorted(got) == sorted(weights)
    for key in weights:
        np.testing.assert_allclose(got[key], weights[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_a_stop_that_outlasts_its_grace_time_ends_with_the_newest_complete_checkpoint_named(tmp_path: Path) -> None:
    """Each step after the signal takes 0.2 s and the window closes only at the epoch's end: the 0.5 s of
    ``grace_s`` run out first. The process ends with code 75 and says which checkpoint stays the one to resume
    from; the one it had written before the signal is still whole (a resume takes it)."""
    spec = json.loads((spec_file(tmp_path, "SIGTERM", log_every_n_steps=1000)).read_text())
    spec["preemption"]["grace_s"] = 0.5
    spec["checkpoint"] = {"every_n_steps": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    stopped = job(out, tmp_path / "spec.json", "python", SIGNAL_AT="3", SIGNAL_SLOW="0.2")
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if "did not end within" in line]
    assert lines == [f"polytrain: rank 0: preempted by SIGTERM: the stop did not end within preemption.grace_s=0.5 s;"
                     f" the newest complete checkpoint in {out / 'checkpoints'} stays the one to resume from (exit "
                     f"code 75)"], stopped.stderr[-3000:]
    resumed = job(out, tmp_path / "spec.json", "python", resume=True)
    check(resumed)
    resumes = read_metrics(out, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] >= 2 and resumes[0]["step"] % 2 == 0, resumes

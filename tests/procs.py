"""Helpers for tests that start real processes: timeouts, loopback pinned, no process left behind.

Import as ``from procs import run, check, loopback_env, free_port`` (tests/ is on pytest's pythonpath).
A training job: ``train`` starts ``polytrain train`` the way a launcher does (`command`), ``read_metrics``
and ``step_losses`` read what its rank 0 logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A master port for a test job: below the kernel's ephemeral range, with the 8 after it free too
    (tf-multiworker's workers listen on ``master_port + 1 + local rank``): a port the kernel picked, as a bind
    to port 0 gives, could be taken by the local end of any outgoing connection before the job binds it or the
    ones after it ("Could not start gRPC server")."""
    from polytrain.comm.net import port_to_hold

    return port_to_hold(count=9)


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment for a multi-process test: loopback only, one thread per rank, MPI as root, and MPI ranks
    that yield the core while they wait (Open MPI's default only where mpirun sees more ranks than cores; the
    suite runs three jobs at once on two cores, so a rank spinning in a collective takes CPU from the others)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_",
                                                                     "TORCHELASTIC_", "PMIX_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "GROUP_RANK"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
        OMPI_MCA_oob_tcp_if_include="lo", OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


def _tagged(token: str) -> dict[int, str]:
    """The live processes whose environment carries ``token`` (workers in sessions of their own too), with
    their command lines; a zombie's environment reads empty, so the dead are not counted."""
    needle = f"POLYTRAIN_TEST_TOKEN={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def _kill_tagged(token: str) -> None:
    """SIGKILL every process whose environment carries ``token``."""
    for pid in _tagged(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


class Finished(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """A finished command, with ``left_behind``: the command lines of the processes it started that were
    still running when it exited (``run`` kills them then; a test asserts there were none)."""

    left_behind: list[str] = []


def run(cmd: list[str], *, timeout: float = 240, env: dict[str, str] | None = None,
        cwd: Path | str | None = None) -> Finished:
    """Run ``cmd`` in its own session; on timeout kill it and everything it started, and fail the test.

    Every process started gets a unique ``POLYTRAIN_TEST_TOKEN`` in its environment, so even workers a
    launcher put in sessions of their own are found and killed when the command ends.
    """
    token = uuid.uuid4().hex
    env = dict(env if env is not None else loopback_env(), POLYTRAIN_TEST_TOKEN=token)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd or REPO, start_new_session=True)
    left: dict[int, str] = {}
    try:
        out, err = proc.communicate(timeout=timeout)
        left = _tagged(token)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # let a launcher stop its workers first
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of this group may outlive the test
        except ProcessLookupError:
            pass
        _kill_tagged(token)
    result = Finished(cmd, proc.returncode, out, err)
    result.left_behind = sorted(left.values())
    return result


def check(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (
        f"exit {result.returncode}: {' '.join(result.args)}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-4000:]}")
    return result


# ------------------------------------------------------------------------------ training jobs

CLI = ["-m", "polytrain.cli"]
PYTHON = (sys.executable,)


def command(launcher: str, program: Sequence[str], nproc: int = 1, *, exports: Sequence[str] = (),
            python: Sequence[str] = PYTHON) -> list[str]:
    """``program`` (a script and its arguments, or ``-m module ...``) started on ``nproc`` ranks by ``launcher``:

    ``python`` one process (``python``: the interpreter's command, e.g. a wrapper that sets limits first);
    ``torchrun`` on loopback at a free port; ``mpirun`` (Open MPI, ``-x NAME`` for each of ``exports``);
    ``horovodrun-gloo`` / ``horovodrun-mpi`` on localhost's ``nproc`` slots over ``lo``; ``launch-<name>``:
    ``polytrain launch --launcher <name>`` (``-x NAME`` for each of ``exports``), whose program is a spec or a script
    (no ``-m``).
    """
    if launcher == "python":
        return [*python, *program]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", *program]
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "--oversubscribe", "-np", str(nproc), *[a for name in exports for a in ("-x", name)],
                *python, *program]
    if launcher in ("horovodrun-gloo", "horovodrun-mpi"):
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", f"--{launcher.partition('-')[2]}",
                "--network-interface", "lo", *python, *program]
    if launcher.startswith("launch-"):
        return [*python, *CLI, "launch", "--launcher", launcher.partition("-")[2], "-np", str(nproc),
                *[a for name in exports for a in ("-x", name)], *program]
    raise ValueError(f"unknown launcher {launcher!r}")


def job_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """`loopback_env` with ``env`` on top; a None value removes the variable (``MASTER_ADDR: None``: the ranks
    agree on a master themselves, as under a plain mpirun)."""
    out = loopback_env()
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def set_args(sets: Sequence[str]) -> list[str]:
    """``--set KEY=VALUE`` for each of ``sets``."""
    return [a for s in sets for a in ("--set", s)]


def train(out: Path, sets: Sequence[str] = (), *, spec: Path | str | None = None, launcher: str | None = None,
          nproc: int = 1, resume: Path | str | None = None, args: Sequence[str] = (), quiet: bool = True,
          env: Mapping[str, str | None] | None = None, exports: Sequence[str] = (), python: Sequence[str] = PYTHON,
          timeout: float = 240) -> Finished:
    """``polytrain train [SPEC] [--quiet] --set output=OUT --set SETS... [--resume R] ARGS...``, started by
    ``launcher`` (see `command`; by default one process without a launcher, more under torchrun) in `job_env`
    with ``env``. The finished command, not checked: wrap it in `check` where the run must succeed."""
    launcher = launcher or ("python" if nproc == 1 else "torchrun")
    train_args = [*([str(spec)] if spec is not None else []), *(["--quiet"] if quiet else []),
                  *set_args([f"output={out}", *sets]), *(["--resume", str(resume)] if resume is not None else []),
                  *args]
    program = train_args if launcher.startswith("launch-") else [*CLI, "train", *train_args]
    return run(command(launcher, program, nproc, exports=exports, python=python), env=job_env(env), timeout=timeout)


def read_metrics(out: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records rank 0 wrote to ``out/metrics.jsonl``, in order; with ``event`` only that kind (``step``,
    ``epoch``, ``resume``, ...)."""
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return records if event is None else [r for r in records if r["event"] == event]


def step_losses(out: Path) -> np.ndarray:
    """The loss of every logged step, in the order logged."""
    return np.array([r["loss"] for r in read_metrics(out, "step")])


def losses_by_step(out: Path) -> dict[int, float]:
    """Each logged step's loss by its step number (a resumed run's steps after the ones it resumed from)."""
    return {r["step"]: r["loss"] for r in read_metrics(out, "step")}


@dataclass
class Trained:
    """A run that succeeded (`trained_run`): its per-step losses, final weights and manifest (``model.json``), its
    whole output, and what it left running (`run`'s ``left_behind``)."""

    losses: np.ndarray
    state: dict[str, np.ndarray]
    manifest: dict[str, Any]
    output: str
    left_behind: list[str]


def trained_run(out: Path, sets: Sequence[str] = (), **train_kw: Any) -> Trained:
    """`train` (``train_kw``: its keywords), which must succeed, and what the run wrote."""
    from polytrain.checkpoint.store import read_model

    result = check(train(out, sets, **train_kw))
    state, manifest = read_model(out)
    return Trained(step_losses(out), state, manifest, result.stdout + result.stderr, result.left_behind)


PLAN_WORKER = str(REPO / "tests" / "multiproc" / "resume_worker.py")


def trained_runs(root: Path, nproc: int, runs: Mapping[str, tuple[Sequence[str], Path | None]],
                 sets: Sequence[str] = (), timeout: float = 800) -> dict[str, Trained]:
    """Several runs of the spec ``sets`` (name: its own sets and a checkpoint to resume, or None) in turn on the
    same ``nproc`` ranks, in one launch of ``resume_worker.py`` (torchrun; one process without a launcher),
    each into ``root/name``: a launch costs seconds of CPU before it trains (torch, the agent). Each run as
    `trained_run` returns it, the launch's output and what it left running in every one."""
    from polytrain.checkpoint.store import read_model

    outs = {name: root / name for name in runs}
    plan = {"sets": list(sets), "runs": [{"sets": list(own), "output": str(outs[name]),
                                          **({"resume": str(resume)} if resume is not None else {})}
                                         for name, (own, resume) in runs.items()]}
    done = check(run(command("python" if nproc == 1 else "torchrun", [PLAN_WORKER, json.dumps(plan)], nproc),
                     env=job_env(), timeout=timeout))
    result = {}
    for name, out in outs.items():
        state, manifest = read_model(out)
        result[name] = Trained(step_losses(out), state, manifest, done.stdout + done.stderr, done.left_behind)
    return result


def one_model_on_every_rank(run: Trained, nproc: int, label: str) -> None:
    """``run`` had ``nproc`` ranks, left nothing running, and every rank ended with the same full model (the
    digests of their states agree); each rank reported its peak memory, printed with ``label`` for a regression
    to show."""
    assert not run.left_behind, run.left_behind
    assert run.manifest["world_size"] == nproc
    assert len(set(run.manifest["rank_state_digests"])) == 1, run.manifest["rank_state_digests"]
    peaks = [rank["host"] for rank in run.manifest["rank_peak_memory"]]
    assert len(peaks) == nproc and min(peaks) > 0
    print(f"\n{label} × {nproc}: peak resident MiB per rank {[round(p / 2**20) for p in peaks]}")

"""Starting the GPU check's workers: one process per rank, all on the one device, with a time limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu.cases import REPO
from bench.gpu.report import last_line

#: how long the other ranks may go on after one rank failed
GRACE_S = 20.0
#: launcher variables a worker must not inherit: it is told its rank and world explicitly
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "HOROVOD_", "LSB_", "JSM_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")


@dataclass
class JobResult:
    """Each rank's list of run records, and how the processes ended."""

    ranks: list[list[dict[str, Any]]]
    returncodes: list[int | None]
    timed_out: bool
    log: str
    seconds: float
    logs: list[str] = field(default_factory=list)

    def run(self, name: str) -> dict[str, Any] | None:
        """Rank 0's record of the run ``name`` (a failing rank's, when another rank failed it)."""
        found = [next((r for r in rank if r.get("name") == name), None) for rank in self.ranks]
        failed = [r for r in found if r is not None and "error" in r]
        if failed:
            return failed[0]
        return found[0] if found else None

    def why_missing(self) -> str:
        """What to say of a run that left no record."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        codes = [c for c in self.returncodes if c not in (0, None)]
        code = f"exit code {codes[0]}: " if codes else ""
        return f"{code}{last_line(self.log)}"


def worker_env(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: the caller's, without launcher variables, on loopback."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env.update({"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"})
    # bench/ from this tree, after whatever the caller put first (an installed polytrain)
    paths = [*([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU: the backends pick the CPU
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def _free_ports(count: int) -> list[int]:
    """Ports for runs that start one after another, minutes apart: held below the ephemeral range (an
    OS-picked free port was taken by a gloo connection of an earlier run, in CI)."""
    from polytrain.comm.net import port_to_hold

    ports: list[int] = []
    for _ in range(count):
        ports.append(port_to_hold(taken=set(ports)))
    return ports


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a worker we started, with the processes it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float, grace: float = GRACE_S) -> bool:
    """Wait until every worker ended, or the deadline passed (True), or one failed and the others did not
    end within ``grace`` seconds after it (they are stuck in a collective with it)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if now >= deadline:
            return True
        if failed_at is None and any(p.poll() not in (0, None) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            return False
        time.sleep(0.1)
    return False


def run_job(job: dict[str, Any], job_dir: Path, *, nproc: int, device: str, timeout: float,
            env: dict[str, str] | None = None) -> JobResult:
    """Run ``job`` on ``nproc`` ranks (processes on the one device); wait at most ``timeout`` seconds."""
    job_dir.mkdir(parents=True, exist_ok=True)
    runs = job.get("runs", [])
    job = {**job, "out_dir": str(job_dir), "nproc": nproc, "device": device,
           "stop_on_error": job.get("stop_on_error", nproc > 1)}
    ports = _free_ports(len(runs) + 1)
    job["ports"], job["group_port"] = ports[:-1], ports[-1]
    path = job_dir / "job.json"
    path.write_text(json.dumps(job))
    full_env = worker_env(device, env)
    started = time.perf_counter()
    procs, logs = [], []
    for rank in range(nproc):
        log = job_dir / f"rank{rank}.log"
        logs.append(log)
        with log.open("wb") as sink:
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.gpu.worker", str(path), str(rank)],
                                          cwd=REPO, env=full_env, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    timed_out = _wait(procs, started + timeout)
    for proc in procs:
        _stop(proc)
    ranks = []
    for rank in range(nproc):
        out = job_dir / f"rank{rank}.json"
        try:
            ranks.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            ranks.append([])
    texts = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    failing = [t for t, p in zip(texts, procs) if p.returncode not in (0, None)]
    return JobResult(ranks, [p.returncode for p in procs], timed_out, (failing or texts or [""])[0],
                     time.perf_counter() - started, texts)

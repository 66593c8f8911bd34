"""How fast jobs end after a fault, against the timeout that bounds each, and whether anything is left behind.

Run:  python bench/fault_timing.py [--only launchers,peers,rendezvous,horovod,watchdog]   (~3.5 min on 2 cores)

The tests (tests/multiproc/test_peer_failures.py, test_reliability.py, test_rendezvous.py,
tests/horovod/torch/test_misuse.py, tests/test_watchdog.py) assert how a fault ends a job — exit
codes, the rank named, the one line, no process left; the times are measured here, where a loaded
machine makes a figure slow instead of a test red. Each row gives the seconds, the timeout that
bounds them where one does, and their ratio (``x timeout``; below 1: the fault was detected before
the timeout could fire).

- launchers: rank 1 fails at its 7th training forward (``kill`` SIGKILL, ``raise``, ``exit`` via
  ``os._exit(3)``, ``stall`` sleeping far past ``reliability.collective_timeout_s``, 10 s here) under
  torchrun, mpirun and ``polytrain launch`` (local); from the fault (the faulty rank writes the time
  just before it acts) to the launcher's exit.
- peers: two ranks started by hand (torchrun-style variables, no launcher to stop the survivor): rank 1
  is SIGKILLed; from the kill to the survivor's exit, which names the lost rank.
- rendezvous: a rank whose master nobody listens on, and one rank of a world of 3; from the start to
  the one-line error, against ``reliability.startup_timeout_s`` (interpreter and torch start-up included).
- horovod: a rank that skips an allreduce (tests/horovod/torch/workers/misuse.py ``stall``); from the
  start to the job's end, against HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.
- watchdog: the stall warning's real thread, in this process: from the last progress to the warning,
  against ``reliability.stall_warning_s``; and how long ``lost_ranks`` waits for heartbeats.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from polytrain.comm.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FAULTS = ("kill", "raise", "exit", "stall")
LAUNCHERS = ("torchrun", "mpirun", "polytrain-local")
COLLECTIVE_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 4.0
HOROVOD_SHUTDOWN_S = 4.0
Row = tuple[str, str, float, float | None, int, int]  # section, case, seconds, timeout, exit code, left behind


def make(info, hidden: int = 64):  # noqa: ANN001, ANN201 - the model factory the spec names
    import torch
    from torch import nn

    class Faulty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            size = int(torch.tensor(info.input_shape).prod())
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, info.num_outputs))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.calls += 1
                rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
                stamp = Path(os.environ["FAULT_STAMP"])
                if rank == "1" and self.calls == 7 and not stamp.exists():  # once: a restarted group trains on
                    stamp.write_text(repr(time.time()))
                    fault = os.environ["FAULT"]
                    if fault == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif fault == "raise":
                        raise RuntimeError("injected failure")
                    elif fault == "exit":
                        os._exit(3)
                    else:
                        time.sleep(600)
            return self.body(x)

    return Faulty()


def leftovers(token: str) -> int:
    needle = f"POLYTRAIN_BENCH_TOKEN={token}".encode()
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    count += 1
            except OSError:
                continue
    return count


def job_env(token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "SLURM_", "TORCHELASTIC_", "HOROVOD_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).parent), POLYTRAIN_BENCH_TOKEN=token, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
               TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra)
    return env


def train_args(output: Path, *sets: str) -> list[str]:
    return ["-m", "polytrain.cli", "train", "--quiet", "--set", "model.name=fault_timing:make", "--set",
            f"reliability.collective_timeout_s={COLLECTIVE_TIMEOUT_S:g}", "--set", "loop.epochs=1", "--set",
            f"output={output}", *[a for s in sets for a in ("--set", s)]]


def finish(proc: subprocess.Popen, token: str, timeout: float = 300) -> tuple[float, int, int]:
    """Wait for ``proc``: the moment it exited, its exit code, and how many of its processes outlived it
    (counted right away, then killed)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    ended = time.time()
    left = leftovers(token)
    kill_tagged(token)
    return ended, proc.returncode, left


def kill_tagged(token: str) -> None:
    needle = f"POLYTRAIN_BENCH_TOKEN={token}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue


def since_stamp(stamp: Path, ended: float) -> float:
    return ended - float(stamp.read_text()) if stamp.exists() else float("nan")


def launcher_row(launcher: str, fault: str, tmp: Path) -> Row:
    token = uuid.uuid4().hex
    stamp = tmp / f"{launcher}-{fault}.stamp"
    train = train_args(tmp / token)
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               *train]
    elif launcher == "mpirun":
        cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "FAULT", "-x", "FAULT_STAMP", "-x",
               "PYTHONPATH", "-x", "POLYTRAIN_BENCH_TOKEN", sys.executable, *train]
    else:
        spec = tmp / "spec.yaml"
        spec.write_text("framework: torch\n")
        cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", str(spec),
               *train[3:]]
    env = job_env(token, FAULT=fault, FAULT_STAMP=str(stamp))
    if launcher == "mpirun":
        env.pop("MASTER_ADDR")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended, code, left = finish(proc, token)
    return ("launchers", f"{launcher} {fault}", since_stamp(stamp, ended), COLLECTIVE_TIMEOUT_S, code, left)


def peers_row(tmp: Path) -> Row:
    """Two ranks by hand; rank 1 SIGKILLs itself mid-step; rank 0 must notice and exit."""
    token, port = uuid.uuid4().hex, str(free_port())
    stamp = tmp / "peers.stamp"
    procs = []
    for rank in (0, 1):
        env = job_env(token, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_PORT=port, FAULT="kill", FAULT_STAMP=str(stamp))
        procs.append(subprocess.Popen([sys.executable, *train_args(tmp / f"peers{rank}")], env=env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, text=True,
                                      stderr=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    procs[1].wait(timeout=300)
    survivor_err = procs[0].communicate(timeout=300)[1]
    ended, code, left = finish(procs[0], token)
    named = "rank 1 stopped responding" in survivor_err
    return ("peers", f"ddp survivor ({'names' if named else 'does NOT name'} rank 1)", since_stamp(stamp, ended),
            COLLECTIVE_TIMEOUT_S, code, left)


def rendezvous_row(case: str, tmp: Path) -> Row:
    token = uuid.uuid4().hex
    rank, world = ("1", "2") if case == "unreachable master" else ("0", "3")
    env = job_env(token, RANK=rank, WORLD_SIZE=world, MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "polytrain.cli", "train", "--quiet", "--set",
           f"reliability.startup_timeout_s={STARTUP_TIMEOUT_S:g}", "--set", f"output={tmp / token}"]
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended, code, left = finish(proc, token, timeout=120)
    return ("rendezvous", case, ended - started, STARTUP_TIMEOUT_S, code, left)


def horovod_row(launcher: str, tmp: Path) -> Row:
    token = uuid.uuid4().hex
    script = REPO / "tests" / "horovod" / "torch" / "workers" / "misuse.py"
    env = job_env(token, RESULT_DIR=str(tmp), POLYTRAIN_HOROVOD_IMPL="shim", HOROVOD_STALL_CHECK_TIME_SECONDS="2",
                  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=f"{HOROVOD_SHUTDOWN_S:g}")
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", str(script), "stall"]
    else:
        env.pop("MASTER_ADDR")
        cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "POLYTRAIN_BENCH_TOKEN", sys.executable,
               str(script), "stall"]
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended, code, left = finish(proc, token, timeout=200)
    return ("horovod", f"{launcher} skipped allreduce", ended - started, HOROVOD_SHUTDOWN_S, code, left)


def watchdog_rows() -> list[Row]:
    """The real watchdog thread and clock: a stalled activity, and the wait in lost_ranks."""
    import threading

    from polytrain.observe.watchdog import Activity, StallWatchdog

    rows: list[Row] = []
    for warn_after in (0.5, 2.0):
        warned, at = threading.Event(), []

        def emit(_line: str, warned: threading.Event = warned, at: list[float] = at) -> None:
            at.append(time.monotonic())
            warned.set()

        activity = Activity()
        activity.set("forward", step=1)
        dog = StallWatchdog(0, 1, activity, warn_after_s=warn_after, timeout_s=300, board=None, emit=emit).start()
        warned.wait(timeout=60)
        dog.stop()
        seconds = (at[0] if at else float("nan")) - activity.since
        rows.append(("watchdog", f"stall warning, stall_warning_s={warn_after:g}", seconds, warn_after, 0, 0))

    class Board:
        def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
            pass

        def read(self, ranks: range) -> dict[int, tuple[int, str]]:
            return {}

        def beats(self, ranks: range) -> dict[int, int]:
            return {}

    dog = StallWatchdog(0, 2, Activity(), warn_after_s=4.0, timeout_s=300, board=Board())
    started = time.monotonic()
    dog.lost_ranks()
    rows.append(("watchdog", "lost_ranks wait (period 1 s)", time.monotonic() - started, None, 0, 0))
    return rows


SECTIONS: dict[str, Callable[[Path], list[Row]]] = {
    "launchers": lambda tmp: [launcher_row(launcher, fault, tmp) for launcher in LAUNCHERS for fault in FAULTS],
    "peers": lambda tmp: [peers_row(tmp)],
    "rendezvous": lambda tmp: [rendezvous_row(case, tmp) for case in ("unreachable master", "1 of 3 ranks came")],
    "horovod": lambda tmp: [horovod_row(launcher, tmp) for launcher in ("torchrun", "mpirun")],
    "watchdog": lambda tmp: watchdog_rows(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections (default: all)")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)} (allowed: {', '.join(SECTIONS)})")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="polytrain-faults-") as tmp_name:
        for name in chosen:
            rows += SECTIONS[name](Path(tmp_name))
    print(f"{'section':<11} {'case':<44} {'seconds':>8} {'timeout':>8} {'x timeout':>9} {'exit':>5} {'left':>5}")
    for section, case, seconds, timeout, code, left in rows:
        limit = f"{timeout:8.1f}" if timeout else f"{'-':>8}"
        ratio = f"{seconds / timeout:9.2f}" if timeout else f"{'-':>9}"
        print(f"{section:<11} {case:<44} {seconds:8.1f} {limit} {ratio} {code:5d} {left:5d}")


if __name__ == "__main__":
    main()

"""How fast a 2-rank job ends after a fault, per launcher, and whether anything is left behind.

Run:  python bench/fault_timing.py        (~3 min on 2 cores)

Faults, injected by the model factory below (``model.name: fault_timing:make``) into rank 1 at
its 7th training forward: ``kill`` (SIGKILL), ``raise`` (an exception), ``exit`` (``os._exit(3)``)
and ``stall`` (sleeps far beyond ``reliability.collective_timeout_s``, 10 s here). Just before
it acts, the faulty rank writes the time to a file; the figure is the time from then until the
launcher command exits. Afterwards every process that carried this run's token in its
environment must be gone. Launchers: torchrun, mpirun and ``polytrain launch`` (local).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from polytrain.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FAULTS = ("kill", "raise", "exit", "stall")
LAUNCHERS = ("torchrun", "mpirun", "polytrain-local")


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
                if rank == "1" and self.calls == 7:
                    Path(os.environ["FAULT_STAMP"]).write_text(repr(time.time()))
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


def run(launcher: str, fault: str, tmp: Path) -> tuple[float, int, int]:
    token = uuid.uuid4().hex
    stamp = tmp / f"{launcher}-{fault}.stamp"
    train = ["-m", "polytrain.cli", "train", "--quiet", "--set", "model.name=fault_timing:make", "--set",
             "reliability.collective_timeout_s=10", "--set", "loop.epochs=1", "--set", f"output={tmp / token}"]
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_", "TORCHELASTIC_"))}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", FAULT=fault,
               FAULT_STAMP=str(stamp), PYTHONPATH=str(Path(__file__).parent), POLYTRAIN_BENCH_TOKEN=token,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo")
    if launcher == "mpirun":
        env.pop("MASTER_ADDR")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    ended = time.time()
    time.sleep(1)
    left = leftovers(token)
    seconds = ended - float(stamp.read_text()) if stamp.exists() else float("nan")
    return seconds, proc.returncode, left


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="polytrain-faults-") as tmp_name:
        rows = [(launcher, fault, *run(launcher, fault, Path(tmp_name))) for launcher in LAUNCHERS for fault in FAULTS]
    print("rank 1 fails at its 7th step; time from the fault to the launcher's exit (collective timeout 10 s)")
    print(f"{'launcher':<16} {'fault':<6} {'seconds':>8} {'exit':>5} {'left behind':>12}")
    for launcher, fault, seconds, code, left in rows:
        print(f"{launcher:<16} {fault:<6} {seconds:8.1f} {code:5d} {left:12d}")


if __name__ == "__main__":
    main()

"""Preemption's figures: the time from a SIGTERM to the job's exit, and the steps lost, against torchrun's kill.

Run:  python bench/preemption.py [--ranks 2] [--signal-after 60]   (~2 min on 2 cores)

One job, 2 ranks of ddp under torchrun: the digits data on a wider MLP (hidden [1024, 1024], ~2.2 M parameters:
a checkpoint of ~26 MB with its momentum), logging every 10 steps. Once the job has logged step
``--signal-after``, the bench sends SIGTERM to torchrun's agent, which passes it on to every rank (what
Kubernetes and Slurm send), and times the exit.

- ``preemption: {}`` with a synchronous save, then with ``checkpoint.async_save``: the ranks stop at the next
  logging window, write a checkpoint there and exit 75. Steps lost: the steps run past the checkpoint the job
  resumes from (0 is the goal: the checkpoint is at the stop). The steps between the signal and the stop are
  run, not lost: the resumed job starts after them.
- the reference, without the table (what a job without preemption handling loses to torchrun's restart): a
  checkpoint every 50 steps, the ranks killed by the signal; lost: the steps past the last checkpoint.

The tests (tests/multiproc/test_preemption.py, tests/cluster/test_slurm.py) assert the stop step, the exit code
and the resumed weights; the times are measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polytrain.comm.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMON = ("model.params.hidden_sizes=[1024,1024]", "loop.epochs=1000", "loop.log_every_n_steps=10", "backend=ddp")
CASES = {
    "preemption, sync save": ("preemption.grace_s=120",),
    "preemption, async save": ("preemption.grace_s=120", "checkpoint.async_save=true"),
    "no table (reference)": ("checkpoint.every_n_steps=50",),
}


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("event") == "step":
            steps.append(int(record["step"]))
    return steps


def saved_steps(out: Path) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")) if folder.is_dir() else []


def one(name: str, sets: tuple[str, ...], ranks: int, after: int, root: Path) -> dict:
    out = root / re.sub(r"\W+", "-", name)
    cmd = [str(BIN / "torchrun"), f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "polytrain.cli", "train", str(REPO / "examples" / "digits.yaml"),
           "--quiet", *[a for s in (*COMMON, *sets, f"output={out}") for a in ("--set", s)]]
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "PATH": f"{BIN}:/usr/bin:/bin"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(s >= after for s in logged_steps(out)):
            if job.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the job never logged step {after}:\n{job.stdout.read()[-2000:]}")
            time.sleep(0.05)
        at = max(logged_steps(out))
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        text, _ = job.communicate(timeout=300)
        seconds = time.monotonic() - sent
    finally:
        if job.poll() is None:
            job.kill()
    found = re.search(r"every rank stopped after step (\d+), its checkpoint written at step (\d+)", text)
    saved = saved_steps(out)
    if found:
        stop, resume_from = int(found.group(1)), int(found.group(2))
    else:  # killed: the run resumes from its last periodic checkpoint, everything past it is run again
        stop, resume_from = max([at, *logged_steps(out)]), (saved[-1] if saved else 0)
    return {"case": name, "seconds": seconds, "logged_at_signal": at, "stop": stop, "resume_from": resume_from,
            "lost": stop - resume_from, "preempted": bool(found), "code": job.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--signal-after", type=int, default=60, help="send SIGTERM once this step is logged")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polytrain-preemption-") as tmp:
        rows = [one(name, sets, args.ranks, args.signal_after, Path(tmp)) for name, sets in CASES.items()]
    reference = rows[-1]
    print(f"{'case':<24} {'signal→exit s':>13} {'stop':>5} {'resumes at':>10} {'steps lost':>10}  vs reference")
    for row in rows:
        ratio = (f"{row['lost']} vs {reference['lost']} lost" if row is not reference
                 else "(killed: resumes from its last periodic checkpoint)")
        print(f"{row['case']:<24} {row['seconds']:>13.2f} {row['stop']:>5} {row['resume_from']:>10} "
              f"{row['lost']:>10}  {ratio}")
    print(json.dumps(rows))
    return 0 if all(r["lost"] == 0 for r in rows[:-1]) else 1


if __name__ == "__main__":
    sys.exit(main())

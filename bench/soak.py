"""Soak: a 2-rank transformer run of at least 10 minutes with a checkpoint about every minute, and
each rank's resident memory (RSS) over time. No leak means: RSS at the end within 10 % of RSS
after the first epoch.

Run:  python bench/soak.py [--minutes 10]

A short calibration run measures steps per second, so that the soak run lasts ``--minutes``
and checkpoints every ~60 s (``checkpoint.every_n_steps``). While it runs, the RSS of both
worker processes is sampled from /proc every few seconds; the first epoch's end comes from
the run's metrics.jsonl. Prints, per rank: RSS after the first epoch, at the end, the ratio,
and the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polytrain.comm.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LM = ["model.name=transformer", "data.name=tokens", "data.tokens.samples=2048", "data.tokens.seq_len=64",
      "data.tokens.vocab=64", "model.params.d_model=128", "model.params.n_heads=4", "model.params.n_layers=4",
      "optimizer.name=adamw", "optimizer.lr=0.001", "data.batch_size=16", "loop.log_every_n_steps=10"]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_", "TORCHELASTIC_"))}
    out.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return out


def torchrun(out: Path, sets: list[str]) -> subprocess.Popen:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "polytrain.cli", "train", "--quiet",
           *[a for s in [*LM, f"output={out}", *sets] for a in ("--set", s)]]
    return subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def workers(out: Path) -> dict[int, int]:
    """rank → pid of the training processes of the run writing to ``out``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"output={out}".encode() in cmdline and b"polytrain.cli" in cmdline and b"torchrun" not in cmdline[1]:
            ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = int(entry.name)
    return found


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def steps_per_second(tmp: Path) -> float:
    out = tmp / "calibrate"
    proc = torchrun(out, ["loop.epochs=1", "loop.max_steps=60"])
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"calibration run failed: {proc.stderr.read()[-2000:]}")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"][1:]  # the first window includes start-up
    seconds = sum(10 * 16 * 2 / e["samples_per_s"] for e in steps)
    return 10 * len(steps) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polytrain-soak-") as tmp_name:
        tmp = Path(tmp_name)
        rate = steps_per_second(tmp)
        per_epoch = -(-int(2048 * 0.8) // 32)
        total = int(rate * args.minutes * 60)
        every = max(1, int(rate * 60))
        epochs = -(-total // per_epoch)
        out = tmp / "soak"
        started = time.monotonic()
        proc = torchrun(out, [f"loop.epochs={epochs}", f"loop.max_steps={total}",
                              f"checkpoint.every_n_steps={every}", "checkpoint.keep_last=2"])
        samples: dict[int, list[tuple[float, float]]] = {}
        while proc.poll() is None:
            for rank, pid in workers(out).items():
                value = rss_mib(pid)
                if value is not None:
                    samples.setdefault(rank, []).append((time.time(), value))
            time.sleep(3)
        if proc.returncode != 0:
            raise SystemExit(f"soak run failed: {proc.stderr.read()[-2000:]}")
        minutes = (time.monotonic() - started) / 60
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first_epoch = next(e["time"] for e in events if e["event"] == "epoch")
        saves = sum(e["event"] == "checkpoint" for e in events)
    print(f"transformer LM, 2 ranks (DDP, gloo), {total} steps in {minutes:.1f} min, {saves} checkpoints "
          f"(every {every} steps, ~1 min)")
    print(f"{'rank':>4} {'RSS after epoch 1':>18} {'RSS at end':>11} {'end/epoch1':>11} {'peak':>9}")
    for rank in sorted(samples):
        series = samples[rank]
        after = next(v for t, v in series if t >= first_epoch)
        end = series[-1][1]
        print(f"{rank:>4} {after:>14.1f} MiB {end:>7.1f} MiB {end / after:>11.3f} {max(v for _, v in series):>5.1f} MiB")


if __name__ == "__main__":
    main()

"""Ray Train against torchrun for the same spec on 2 ranks: the time to the first optimizer step, and how long a
restart takes to train again after a rank is killed.

Run:  python bench/ray_start.py [--repeat 2]   (~2 min on 2 cores)

- first step: from ``polytrain launch --launcher torchrun|ray -np 2`` starting to the first step record in
  ``metrics.jsonl`` (each record carries its wall time; ``log_every_n_steps=1``). Ray's figure includes starting a
  local Ray and its worker actors; ``ratio`` is ray / torchrun.
- recovery: rank 1 SIGKILLs itself at its 7th training forward (`fault_timing.make`, which writes the moment first)
  with ``--max-restarts 1`` and a checkpoint every 5 steps; from the kill to the first step record after the
  resume record (the restarted group's start, its checkpoint load and one step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from fault_timing import job_env, kill_tagged

SPEC = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"
COMMON = ("loop.epochs=1", "loop.log_every_n_steps=1")


def launch(launcher: str, out: Path, sets: tuple[str, ...], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", launcher, "-np", "2",
           *(["--max-restarts", "1"] if "FAULT" in env else []), str(SPEC), "--quiet",
           *[a for s in (*COMMON, *sets, f"output={out}") for a in ("--set", s)]]
    try:
        return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300).returncode
    except subprocess.TimeoutExpired:
        return -1
    finally:
        kill_tagged(env["POLYTRAIN_BENCH_TOKEN"])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def first_step(launcher: str, tmp: Path) -> float:
    out = tmp / f"first-{launcher}-{uuid.uuid4().hex[:6]}"
    token = uuid.uuid4().hex
    started = time.time()
    code = launch(launcher, out, (), job_env(token))
    steps = [r for r in records(out) if r["event"] == "step"] if code == 0 else []
    return steps[0]["time"] - started if steps else float("nan")


def recovery(launcher: str, tmp: Path) -> float:
    out = tmp / f"recovery-{launcher}"
    stamp = tmp / f"stamp-{launcher}"
    token = uuid.uuid4().hex
    code = launch(launcher, out, ("model.name=fault_timing:make", "model.params={}", "checkpoint.every_n_steps=5"),
                  job_env(token, FAULT="kill", FAULT_STAMP=str(stamp)))
    if code != 0 or not stamp.exists():
        return float("nan")
    seen = records(out)
    resumed = [i for i, r in enumerate(seen) if r["event"] == "resume"]
    after = [r for r in seen[resumed[0]:] if r["event"] == "step"] if resumed else []
    return after[0]["time"] - float(stamp.read_text()) if after else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each first-step figure (the best is kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ray-start-") as name:
        tmp = Path(name)
        best = {launcher: min(first_step(launcher, tmp) for _ in range(args.repeat)) for launcher in ("torchrun", "ray")}
        back = {launcher: recovery(launcher, tmp) for launcher in ("torchrun", "ray")}
    print(f"{'':12}{'torchrun':>10}{'ray':>10}{'ratio':>8}")
    print(f"{'first step':12}{best['torchrun']:>9.1f}s{best['ray']:>9.1f}s{best['ray'] / best['torchrun']:>8.2f}")
    print(f"{'recovery':12}{back['torchrun']:>9.1f}s{back['ray']:>9.1f}s{back['ray'] / back['torchrun']:>8.2f}")


if __name__ == "__main__":
    main()

"""``polytrain doctor``'s wall time at 2 and 4 ranks, against a bare launch of the same ranks.

Run:  python bench/doctor.py [--ranks 2,4] [--launcher local]   (~1 min on 2 cores)

The reference is what any check on those ranks costs at the least: the same launcher starting the same number of
ranks, each joining the job (`polytrain.torch.Distributed("ddp")`) and ending it. The ratio says what the doctor's
measurements (the sustained matrix multiply, the ring's ping-pongs, the all-reduce, the gathered records) add
to that; the issue's goal is the doctor under 30 s at 4 ranks here. The named outliers are asserted by
tests/cluster/test_doctor.py, not here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = "from polytrain.torch import Distributed\nDistributed('ddp').end()\n"


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: the doctor found something (a loaded machine); still a full run
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma list of rank counts (default: %(default)s)")
    parser.add_argument("--launcher", default="local", help="default: %(default)s")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "polytrain.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text(BARE)
        print(f"{'ranks':>5}  {'doctor s':>9}  {'bare launch s':>13}  {'ratio':>6}")
        for n in (int(x) for x in args.ranks.split(",")):
            reference = timed([*cli, "launch", "--launcher", args.launcher, "-np", str(n), str(bare)])
            doctor = timed([*cli, "doctor", "--launcher", args.launcher, "-np", str(n), "--path", tmp])
            print(f"{n:>5}  {doctor:>9.1f}  {reference:>13.1f}  {doctor / reference:>5.2f}x")


if __name__ == "__main__":
    main()

"""Issue 33's four figures in one run: the Trainer against a hand-written loop, the Horovod shim against real
Horovod (and its checked single ops against unchecked ones), images against tf.data, and the stall of an
asynchronous checkpoint save against a synchronous one.

Run:  python bench/performance.py [--quick]     (~13 min on 2 cores; --quick: fewer rounds and saves, shorter)

It runs the four benches one after another (`trainer_overhead.py`, `horovod_compat.py --max-mib 16`,
`data_throughput.py --kinds augmented` at 64x64 and 224x224, `async_checkpoint.py`), shows each one's output as
it comes, and ends with a table of the ratios against their targets. Each bench measures its sides interleaved
in its own runs; the figures of one table come from the same sitting of the machine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: (figure, bench and its arguments (full, quick), pattern of the ratio in its output, target)
FIGURES = [
    ("Trainer / hand-written DDP loop", (["trainer_overhead.py", "--rounds", "5"], ["trainer_overhead.py"]),
     r"polytrain Trainer\s*:.*?([\d.]+) x hand", "<= 1.02"),
    ("Lightning Fabric / hand-written DDP loop", None, r"Lightning Fabric loop\s*:.*?([\d.]+) x hand",
     "(the Trainer's peer)"),
    ("Horovod shim / real Horovod, step (MPI)",
     (["horovod_compat.py", "--max-mib", "16"], ["horovod_compat.py", "--max-mib", "1", "--steps", "10"]),
     r"\(b\)/\(a\) = ([\d.]+)", "<= 0.9"),
    ("Horovod shim / DDP, step", None, r"\(b\)/\(c\) = ([\d.]+)", "<= 1.05"),
    ("shim single 4 KiB ops, checked / unchecked", None, r"with its metadata check / without: ([\d.]+)", "<= 1.5"),
    ("images 64x64 augmented, polytrain / tf.data",
     (["data_throughput.py", "--kinds", "augmented"], ["data_throughput.py", "--kinds", "augmented", "--rounds", "1"]),
     r"augmented .*?faster of the two: ([\d.]+)x", ">= 1.0 (vs the faster of DataLoader and tf.data)"),
    ("images 224x224 augmented, polytrain / tf.data",
     (["data_throughput.py", "--kinds", "augmented", "--size", "224", "--images", "1000"],
      ["data_throughput.py", "--kinds", "augmented", "--size", "224", "--images", "1000", "--rounds", "1"]),
     r"augmented .*?faster of the two: ([\d.]+)x", ">= 1.0"),
    ("checkpoint stall, async / sync save (~100 M params)", (["async_checkpoint.py"], ["async_checkpoint.py",
                                                                                          "--saves", "3"]),
     r"ratio async / sync: ([\d.]+)", "<= 0.10"),
]


def run(args: list[str]) -> str:
    """One bench's output, shown as it comes and returned."""
    print(f"$ python bench/{' '.join(args)}", flush=True)
    process = subprocess.Popen([sys.executable, str(HERE / args[0]), *args[1:]], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    if process.wait() != 0:
        raise SystemExit(f"bench/{args[0]} failed (exit {process.returncode})")
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and saves (noisier figures)")
    options = parser.parse_args()
    rows = []
    output = ""
    for figure, bench, pattern, target in FIGURES:
        if bench is not None:  # a figure without its own bench reads the output of the one before
            output = run(bench[1] if options.quick else bench[0])
        found = re.search(pattern, output)
        rows.append((figure, found.group(1) if found else "n/a", target))
    width = max(len(figure) for figure, _, _ in rows)
    print(f"\n{'figure':{width}}  {'ratio':>6}  target")
    for figure, ratio, target in rows:
        print(f"{figure:{width}}  {ratio:>6}  {target}")


if __name__ == "__main__":
    main()

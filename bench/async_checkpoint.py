"""How long a checkpoint save stops training, synchronous against ``checkpoint.async_save``, on a ~100 M-parameter
model (one process, CPU).

Run:  python bench/async_checkpoint.py [--saves 5] [--hidden 7000]   (~2 min on 2 cores, ~3 GB of disk under /tmp)

The model is the zoo's MLP on digits with three hidden layers of ``--hidden`` units (7000: 98.6 M parameters,
394 MB of weights; SGD's momentum doubles a checkpoint to ~790 MB). The Trainer saves every 8 steps (longer than a write takes, as saves usually are apart); its timeline
(``--timeline``) has a ``checkpoint`` span around each save's stop of the loop: gathering and copying the state,
waiting for the previous background write, and — synchronously — writing, hashing, fsyncing and committing the
files. ``stall`` is the median of those spans; ``ratio`` is async / sync (the issue's target: <= 0.10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPEC = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"


def stalls(out: Path, hidden: int, saves: int, background: bool) -> list[float]:
    every = 8  # steps between saves: more than one write takes, as saves usually are apart
    sets = [f"model.params.hidden_sizes=[{hidden},{hidden},{hidden}]", "optimizer.momentum=0.9",
            f"loop.max_steps={every * saves}", f"checkpoint.every_n_steps={every}", f"checkpoint.keep_last={saves}",
            f"checkpoint.async_save={str(background).lower()}", f"output={out}"]
    trace = out / "timeline.json"
    subprocess.run([sys.executable, "-m", "polytrain.cli", "train", str(SPEC), "--quiet", "--timeline", str(trace),
                    *[a for s in sets for a in ("--set", s)]], check=True, timeout=900)
    events = json.loads(trace.read_text())["traceEvents"]
    return [e["dur"] / 1e6 for e in events if e.get("name") == "checkpoint" and "dur" in e]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=7000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="async-ckpt-") as name:
        sync = stalls(Path(name) / "sync", args.hidden, args.saves, False)
        background = stalls(Path(name) / "async", args.hidden, args.saves, True)
    params = 64 * args.hidden + 2 * args.hidden * args.hidden + args.hidden * 10 + 3 * args.hidden + 10
    print(f"{params / 1e6:.1f} M parameters; stall per save (s), {args.saves} saves each")
    print(f"  sync:  {' '.join(f'{s:.2f}' for s in sync)}  median {statistics.median(sync):.2f}")
    print(f"  async: {' '.join(f'{s:.2f}' for s in background)}  median {statistics.median(background):.2f}")
    print(f"  ratio async / sync: {statistics.median(background) / statistics.median(sync):.3f}")


if __name__ == "__main__":
    main()

"""Step time of a 2-rank DDP run reading its data from Parquet files against the same run with the data in
memory (the same samples as an ``.npz``, which polytrain loads whole).

Run:  python bench/data_step_time.py [--rows 200000] [--rounds 3] [--hidden 256]

Both runs: ``polytrain launch --launcher torchrun -np 2``, the MLP on 64 features, batch 256 per rank, one
epoch, the reader threads and read-ahead at their defaults. Step time = 1 / samples-per-second over the
logging windows after the first (warm-up), median per run, best run of ``--rounds``. Prints both and the
ratio file / memory (target <= 1.05: the file reader keeps ahead of the training step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data_throughput import make_parquet  # noqa: E402

BATCH = 256


def spec(data: dict[str, object], out: Path, hidden: int) -> dict[str, object]:
    return {"framework": "torch", "backend": "ddp", "model": {"name": "mlp", "params": {"hidden_sizes": [hidden, hidden]}},
            "data": {**data, "batch_size": BATCH, "val_fraction": 0.05}, "optimizer": {"name": "sgd", "lr": 0.01},
            "loop": {"epochs": 1, "log_every_n_steps": 20}, "output": str(out)}


def run(name: str, spec_data: dict[str, object], root: Path, hidden: int) -> float:
    """Median seconds per step of one 2-rank run (windows after the first)."""
    out = root / f"run-{name}"
    path = root / f"{name}.json"
    path.write_text(json.dumps(spec(spec_data, out, hidden)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "torchrun", "-np", "2", str(path)],
                   check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["samples_per_s"] for r in records if r["event"] == "step"][1:]
    return statistics.median(BATCH * 2 / s for s in speeds if s > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polytrain-step-") as tmp:
        root = Path(tmp)
        make_parquet(root / "rows.parquet", args.rows)
        import pyarrow.parquet as pq

        table = pq.read_table(root / "rows.parquet")
        x = np.stack(table.column("x").to_numpy(zero_copy_only=False)).astype(np.float32)
        np.savez(root / "rows.npz", x=x, y=table.column("label").to_numpy())
        del table, x
        files = {"name": "parquet", "path": str(root / "rows.parquet"), "features": ["x"], "label": "label"}
        memory = {"name": "npz", "path": str(root / "rows.npz")}
        times: dict[str, list[float]] = {"file": [], "memory": []}
        for _ in range(args.rounds):  # interleaved, so a busy moment hits both
            times["file"].append(run("file", files, root, args.hidden))
            times["memory"].append(run("memory", memory, root, args.hidden))
        file_t, mem_t = min(times["file"]), min(times["memory"])
        print(f"step time, 2-rank DDP, MLP {args.hidden}x2, batch {BATCH}/rank, {args.rows} rows:")
        print(f"  Parquet files (read ahead in threads): {file_t * 1e3:7.2f} ms   runs: "
              + ", ".join(f"{t * 1e3:.2f}" for t in times["file"]))
        print(f"  in memory (.npz):                      {mem_t * 1e3:7.2f} ms   runs: "
              + ", ".join(f"{t * 1e3:.2f}" for t in times["memory"]))
        print(f"  file / memory = {file_t / mem_t:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()

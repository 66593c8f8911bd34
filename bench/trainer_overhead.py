"""The polytrain Trainer on DDP vs a hand-written DDP loop: same model, data, batch, optimizer, steps.

Run (2 ranks):  python bench/trainer_overhead.py            (starts itself under torchrun)
Prints the median step time of each and their ratio (target: polytrain / hand-written <= 1.02),
and the cost of recording a timeline (``--timeline``: the Trainer with it on vs off).

Both sides time windows of ``WINDOW`` steps (forward, backward with DDP's all-reduce,
optimizer step, batch slicing) and report the median per-step time over the windows.
The Trainer's own figure comes from its metrics.jsonl (samples/s per logging window).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, WINDOW, BATCH, HIDDEN = 400, 20, 64, (1024, 1024)


def hand_written(out: Path) -> float:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from polytrain.adapters.torch.models import build_model
    from polytrain.data import load_dataset
    from polytrain.spec import DataSpec

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_dataset(DataSpec(batch_size=BATCH), seed=0)
    torch.manual_seed(0)
    model = DDP(build_model("mlp", {"hidden_sizes": list(HIDDEN)}, data.info))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    n = len(x)
    times, step = [], 0
    while step < STEPS:
        order = np.random.default_rng(step).permutation(n)
        start = time.perf_counter()
        for _ in range(WINDOW):
            i = (step * BATCH * world) % (n - BATCH * world)
            idx = torch.from_numpy(order[i + rank * BATCH:i + (rank + 1) * BATCH])
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * (world / (BATCH * world))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            step += 1
        times.append((time.perf_counter() - start) / WINDOW)
    dist.destroy_process_group()
    return float(np.median(times[1:]))


def polytrain_trainer(out: Path, timeline: bool = False) -> float:
    import numpy as np

    from polytrain import validation
    from polytrain.trainer import Trainer

    spec = validation.from_dict({
        "backend": "ddp", "model": {"name": "mlp", "params": {"hidden_sizes": list(HIDDEN)}},
        "data": {"batch_size": BATCH}, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "loop": {"epochs": 100, "max_steps": STEPS, "log_every_n_steps": WINDOW}, "output": str(out)})
    Trainer(spec, show_progress=False, timeline=str(out / "trace.json") if timeline else None).fit()
    if int(os.environ["RANK"]) != 0:
        return 0.0
    windows = [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == "step"]
    world = int(os.environ["WORLD_SIZE"])
    # only full windows: skip the first (warm-up) and epoch-end partial windows
    full = [BATCH * world / e["samples_per_s"] for e in windows[1:] if e["step"] % WINDOW == 0]
    return float(np.median(full))


def worker(which: str, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seconds = hand_written(out) if which == "hand" else polytrain_trainer(out, timeline=which == "timeline")
    if os.environ.get("RANK") == "0":
        (out / f"{which}.json").write_text(json.dumps({"step_s": seconds}))


def main() -> None:
    if len(sys.argv) == 3:
        from polytrain.cli import exit_after_training

        worker(sys.argv[1], Path(sys.argv[2]))
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results = {}
        for which in ("hand", "polytrain", "timeline") * 2:  # interleaved, best of two each
            cmd = [torchrun, "--nproc_per_node=2", "--standalone",
                   __file__, which, str(out)]
            subprocess.run(cmd, check=True, env=env, timeout=900)
            step = json.loads((out / f"{which}.json").read_text())["step_s"]
            results[which] = min(results.get(which, float("inf")), step)
    ratio = results["polytrain"] / results["hand"]
    print(f"model: MLP {HIDDEN} on digits, batch {BATCH}/rank, 2 ranks (DDP, gloo), {STEPS} steps")
    print(f"hand-written DDP loop : {results['hand'] * 1e3:8.3f} ms/step (median)")
    print(f"polytrain Trainer     : {results['polytrain'] * 1e3:8.3f} ms/step (median)")
    print(f"ratio polytrain/hand  : {ratio:.3f}  (target <= 1.02)")
    print(f"with --timeline       : {results['timeline'] * 1e3:8.3f} ms/step (median), "
          f"{results['timeline'] / results['polytrain']:.3f} x without")


if __name__ == "__main__":
    main()

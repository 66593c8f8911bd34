"""The polytrain Trainer on DDP vs a hand-written DDP loop: same model, data, batch, optimizer, steps.

Run (2 ranks):  python bench/trainer_overhead.py [--rounds 3]     (starts itself under torchrun)
Prints the time per step of each and their ratio (target: polytrain / hand-written <= 1.02), and the cost of
recording a timeline (the Trainer with ``timeline`` on vs off).

Both run the same epochs (digits, every sample once per epoch, shuffled per epoch, no validation) and are timed
the same way: the wall time from the end of step ``WARM`` to the end of step ``STEPS`` on rank 0, over that
many steps, so each side pays for everything it does between steps, epoch starts included (forward, backward
with DDP's all-reduce, the optimizer step, the batches, the Trainer's logging, finiteness check and read-ahead).
The runs interleave, each round in a rotated order (hand, polytrain, timeline; polytrain, timeline, hand; ...),
and the fastest of ``--rounds`` runs counts: on a shared 2-core machine a run's time moves by 10-20 % with what
else runs, and the fastest is the least disturbed.
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

STEPS, WARM, BATCH, HIDDEN = 400, 40, 64, (1024, 1024)


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
    data = load_dataset(DataSpec(batch_size=BATCH, val_fraction=0.0), seed=0)
    torch.manual_seed(0)
    model = DDP(build_model("mlp", {"hidden_sizes": list(HIDDEN)}, data.info))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    n = len(x)
    per_epoch = n // (BATCH * world)
    step, epoch, started = 0, 0, 0.0
    while step < STEPS:
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(n))
        for s in range(min(per_epoch, STEPS - step)):
            idx = order[(s * world + rank) * BATCH:(s * world + rank + 1) * BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * (1 / BATCH)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            step += 1
            if step == WARM:
                started = time.perf_counter()
        epoch += 1
    seconds = (time.perf_counter() - started) / (STEPS - WARM)
    dist.destroy_process_group()
    return seconds


class Clock:
    """A Trainer callback: when steps ``WARM`` and ``STEPS`` ended."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}

    def on_step_end(self, run: object, step: int, logs: dict) -> None:
        if step in (WARM, STEPS):
            self.ends[step] = time.perf_counter()


def polytrain_trainer(out: Path, timeline: bool = False) -> float:
    from polytrain import validation
    from polytrain.trainer import Trainer

    spec = validation.from_dict({
        "backend": "ddp", "model": {"name": "mlp", "params": {"hidden_sizes": list(HIDDEN)}},
        "data": {"batch_size": BATCH, "val_fraction": 0.0}, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "loop": {"epochs": 1000, "max_steps": STEPS}, "output": str(out)})
    clock = Clock()
    Trainer(spec, show_progress=False, timeline=str(out / "trace.json") if timeline else None, callbacks=[clock]).fit()
    return (clock.ends[STEPS] - clock.ends[WARM]) / (STEPS - WARM)


def worker(which: str, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out.mkdir(parents=True, exist_ok=True)
    seconds = hand_written(out) if which == "hand" else polytrain_trainer(out, timeline=which == "timeline")
    if os.environ.get("RANK") == "0":
        (out / "result.json").write_text(json.dumps({"step_s": seconds}))


def main() -> None:
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):
        from polytrain.cli import exit_after_training

        worker(sys.argv[1], Path(sys.argv[2]))
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each (the fastest counts)")
    args = parser.parse_args()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results = {}
        kinds = ("hand", "polytrain", "timeline")
        # interleaved, and each round in another order (a run right after another ran slower here, whichever it
        # was); the fastest of each counts
        for which in [kinds[(r + k) % 3] for r in range(args.rounds) for k in range(3)]:
            cmd = [torchrun, "--nproc_per_node=2", "--standalone", __file__, which, str(out / which)]
            subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
            step = json.loads((out / which / "result.json").read_text())["step_s"]
            results[which] = min(results.get(which, float("inf")), step)
    ratio = results["polytrain"] / results["hand"]
    print(f"model: MLP {HIDDEN} on digits, batch {BATCH}/rank, 2 ranks (DDP, gloo); steps {WARM}-{STEPS}, "
          f"fastest of {args.rounds}")
    print(f"hand-written DDP loop : {results['hand'] * 1e3:8.3f} ms/step")
    print(f"polytrain Trainer     : {results['polytrain'] * 1e3:8.3f} ms/step")
    print(f"ratio polytrain/hand  : {ratio:.3f}  (target <= 1.02)")
    print(f"with a timeline       : {results['timeline'] * 1e3:8.3f} ms/step, "
          f"{results['timeline'] / results['polytrain']:.3f} x without")


if __name__ == "__main__":
    main()

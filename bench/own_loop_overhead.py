"""One hand-written loop on raw DDP, on `polytrain.torch.Distributed("ddp")`, and on Accelerate and Lightning
Fabric where they are installed: the same model, data, batch, optimizer and steps; only the set-up and the
backward call differ.

Run (2 ranks):  python bench/own_loop_overhead.py [--steps N]      (starts itself under torchrun)
All variants live in the same two processes and take turns, a window of ``WINDOW`` steps each (A B, then
B A, ...), so a change in the machine's load falls on all of them alike. The process group is made the raw
way (``init_process_group("gloo")``) before anything else; polytrain, Accelerate and Fabric find it made and
use it, as they do under a launcher that made it. Each variant's per-step time is the median over its windows
after the first (warm-up). Printed: each variant's median and its ratio to raw DDP, both as the ratio of the
medians and as the median of the ratios of windows run next to each other.
Target: polytrain <= 1.02 x raw DDP and no slower than either peer. The model and step sizes are those of
bench/trainer_overhead.py.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench/ is a folder of the repository, not installed

from bench.trainer_overhead import BATCH, HIDDEN, STEPS  # noqa: E402

WINDOW = 20  # steps a variant runs before the next one takes its turn

VARIANTS = ("raw", "polytrain", "accelerate", "fabric")
LABELS = {"raw": "raw DDP (torch.distributed)", "polytrain": "polytrain.torch (ddp)", "accelerate": "Accelerate",
          "fabric": "Lightning Fabric"}


def missing(variant: str) -> str | None:
    """None when ``variant`` can run here, else why not."""
    modules = {"accelerate": ("accelerate",), "fabric": ("lightning", "lightning_fabric")}.get(variant)
    if modules is None or any(importlib.util.find_spec(m) is not None for m in modules):
        return None
    return f"{' / '.join(modules)} is not installed"


def _model_and_optimizer() -> tuple[Any, Any]:
    """The same MLP (same initial weights on every rank and in every variant) and its SGD."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sizes = (64, *HIDDEN)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(sizes[-1], 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def raw() -> tuple[Any, Any, Callable[[Any], None], Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, optimizer = _model_and_optimizer()
    return DDP(model), optimizer, lambda loss: loss.backward(), None


def polytrain() -> tuple[Any, Any, Callable[[Any], None], Any]:
    from polytrain.torch import Distributed

    dist = Distributed("ddp")
    model, optimizer = dist.setup(*_model_and_optimizer())
    return model, optimizer, dist.backward, dist.end


def accelerate() -> tuple[Any, Any, Callable[[Any], None], Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(*_model_and_optimizer())
    return model, optimizer, accelerator.backward, None


def fabric() -> tuple[Any, Any, Callable[[Any], None], Any]:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    runner = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    runner.launch()
    model, optimizer = runner.setup(*_model_and_optimizer())
    return model, optimizer, runner.backward, None


class Loop:
    """The loop every variant runs, a window at a time, over its own step counter (the same batches in every
    variant)."""

    def __init__(self, model: Any, optimizer: Any, backward: Callable[[Any], None], x: Any, y: Any) -> None:
        self.model, self.optimizer, self.backward, self.x, self.y = model, optimizer, backward, x, y
        self.step, self.times = 0, []

    def window(self, rank: int, world: int) -> None:
        import numpy as np
        import torch
        import torch.nn.functional as F

        n = len(self.x)
        order = np.random.default_rng(self.step).permutation(n)
        start = time.perf_counter()
        for _ in range(WINDOW):
            i = (self.step * BATCH * world) % (n - BATCH * world)
            idx = torch.from_numpy(order[i + rank * BATCH:i + (rank + 1) * BATCH])
            loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
            self.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()
            self.step += 1
        self.times.append((time.perf_counter() - start) / WINDOW)


def worker(variants: list[str], steps: int) -> None:
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    dist.init_process_group("gloo")  # the raw way; the others find the group made
    rank, world = dist.get_rank(), dist.get_world_size()
    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    make = {"raw": raw, "polytrain": polytrain, "accelerate": accelerate, "fabric": fabric}
    loops, ends = {}, []
    for variant in variants:
        model, optimizer, backward, end = make[variant]()
        loops[variant] = Loop(model, optimizer, backward, x, y)
        ends += [end] if end else []
    for turn in range(max(steps // WINDOW, 2)):
        for variant in variants if turn % 2 == 0 else variants[::-1]:
            loops[variant].window(rank, world)
    for end in ends:
        end()
    dist.destroy_process_group()
    if rank != 0:
        return
    medians = {v: statistics.median(loop.times[1:]) for v, loop in loops.items()}
    print(f"model: MLP {HIDDEN} on digits, batch {BATCH}/rank, {world} ranks (gloo), {steps} steps per variant "
          f"in windows of {WINDOW}, alternated")
    for variant, loop in loops.items():
        paired = statistics.median(a / b for a, b in zip(loop.times[1:], loops["raw"].times[1:]))
        print(f"{LABELS[variant]:28s}: {medians[variant] * 1e3:8.3f} ms/step (median); ratio to raw "
              f"{medians[variant] / medians['raw']:.3f}, paired windows {paired:.3f}")
    print("target: polytrain <= 1.02 x raw DDP, and no slower than Accelerate or Fabric")


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else STEPS
    if "--worker" in sys.argv:
        from polytrain.cli import exit_after_training

        worker(sys.argv[sys.argv.index("--worker") + 1].split(","), steps)
        sys.stdout.flush()
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    variants = []
    for variant in VARIANTS:
        why = missing(variant)
        if why:
            print(f"skipping {LABELS[variant]}: {why}", flush=True)
        else:
            variants.append(variant)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    subprocess.run([torchrun, "--nproc_per_node=2", "--standalone", __file__, "--worker", ",".join(variants),
                    "--steps", str(steps)], check=True, env=env, timeout=1800)


if __name__ == "__main__":
    main()

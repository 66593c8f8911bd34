"""The polytrain Trainer on DDP vs a hand-written DDP loop: same model, data, batch, optimizer, steps.

Run (2 ranks):  python bench/trainer_overhead.py [--rounds 3]     (starts itself under torchrun)
Also the same job as a Lightning Fabric loop, an Accelerate loop and under the Lightning Trainer, where they are
installed. Prints each one's time per step and its ratio to the hand-written loop (target: the Trainer <= 1.02 x
and no slower than Fabric), and the Trainer with a timeline recorded.

Both run the same epochs (digits, every sample once per epoch, shuffled per epoch, no validation) and are timed
the same way: the wall time from the end of step ``WARM`` to the end of step ``STEPS`` on rank 0, over that
many steps, so each side pays for everything it does between steps, epoch starts included (forward, backward
with DDP's all-reduce, the optimizer step, the batches, the Trainer's logging, finiteness check and read-ahead).
The runs interleave, each round in a rotated order (hand, polytrain, timeline; polytrain, timeline, hand; ...),
and the fastest of ``--rounds`` runs counts: on a shared 2-core machine a run's time moves by 10-20 % with what
else runs, and the fastest is the least disturbed. Then each run is paired with the hand loop's run of its
round, and the median and range of those ratios show how large a difference the noise allows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, WARM, BATCH, HIDDEN = 400, 40, 64, (1024, 1024)


def own_loop(which: str) -> float:
    """The hand-written loop on raw DDP (``hand``), or the same loop set up and stepped through Lightning Fabric
    (``fabric``) or Accelerate (``accelerate``), as their users write it."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from polytrain.adapters.torch.models import build_model
    from polytrain.data import load_dataset
    from polytrain.spec.tables import DataSpec

    dist.init_process_group("gloo")  # the peers find the group made, as under a launcher that made it
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_dataset(DataSpec(batch_size=BATCH, val_fraction=0.0), seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", {"hidden_sizes": list(HIDDEN)}, data.info)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    backward = torch.Tensor.backward
    if which == "hand":
        model = DDP(model)
    elif which == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
        fabric.launch()
        model, opt = fabric.setup(model, opt)
        backward = fabric.backward
    else:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        backward = accelerator.backward
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    n = len(x)
    per_epoch = n // (BATCH * world)
    step, epoch, started = 0, 0, 0.0
    while step < STEPS:
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(n))
        for s in range(min(per_epoch, STEPS - step)):
            idx = order[(s * world + rank) * BATCH:(s * world + rank + 1) * BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * (1 / BATCH)
            backward(loss)
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


def lightning_trainer(out: Path) -> float:
    """The same job as a LightningModule under the Lightning Trainer (its DataLoader with a distributed sampler,
    shuffled per epoch; no validation, logger, checkpoints or progress bar)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain.adapters.torch.models import build_model
    from polytrain.data import load_dataset
    from polytrain.spec.tables import DataSpec

    data = load_dataset(DataSpec(batch_size=BATCH, val_fraction=0.0), seed=0)
    ends: dict[int, float] = {}

    class Job(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build_model("mlp", {"hidden_sizes": list(HIDDEN)}, data.info)

        def training_step(self, batch: tuple, index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y, reduction="sum") * (1 / BATCH)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class LightningClock(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step in (WARM, STEPS):
                ends[trainer.global_step] = time.perf_counter()

    loader = DataLoader(TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)),
                        batch_size=BATCH, shuffle=True, drop_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[LightningClock()], default_root_dir=str(out))
    trainer.fit(Job(), loader)
    return (ends[STEPS] - ends[WARM]) / (STEPS - WARM)


class Clock:
    """A Trainer callback: when steps ``WARM`` and ``STEPS`` ended."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}

    def on_step_end(self, run: object, step: int, logs: dict) -> None:
        if step in (WARM, STEPS):
            self.ends[step] = time.perf_counter()


def polytrain_trainer(out: Path, timeline: bool = False) -> float:
    from polytrain import validation
    from polytrain.train.trainer import Trainer

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
    if which in ("hand", "fabric", "accelerate"):
        seconds = own_loop(which)
    elif which == "lightning":
        seconds = lightning_trainer(out)
    else:
        seconds = polytrain_trainer(out, timeline=which == "timeline")
    if os.environ.get("RANK") == "0":
        (out / "result.json").write_text(json.dumps({"step_s": seconds}))


#: what runs, and its label; the peers where they are installed
KINDS = {"hand": "hand-written DDP loop", "polytrain": "polytrain Trainer", "timeline": "... with a timeline",
         "fabric": "Lightning Fabric loop", "accelerate": "Accelerate loop", "lightning": "Lightning Trainer"}
PEERS = {"fabric": "lightning", "accelerate": "accelerate", "lightning": "lightning"}


def main() -> None:
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):
        from polytrain.cli import exit_after_training

        worker(sys.argv[1], Path(sys.argv[2]))
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each (the fastest counts)")
    args = parser.parse_args()
    kinds = [k for k in KINDS if k not in PEERS or importlib.util.find_spec(PEERS[k]) is not None]
    skipped = [f"{KINDS[k]} ({PEERS[k]} is not installed)" for k in KINDS if k not in kinds]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results: dict[str, float] = {}
        rounds: dict[str, list[float]] = {}  # every run's time, in round order
        # interleaved, and each round in another order (a run right after another ran slower here, whichever it
        # was); the fastest of each counts
        for which in [kinds[(r + k) % len(kinds)] for r in range(args.rounds) for k in range(len(kinds))]:
            cmd = [torchrun, "--nproc_per_node=2", "--standalone", __file__, which, str(out / which)]
            subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            step = json.loads((out / which / "result.json").read_text())["step_s"]
            results[which] = min(results.get(which, float("inf")), step)
            rounds.setdefault(which, []).append(step)
    print(f"model: MLP {HIDDEN} on digits, batch {BATCH}/rank, 2 ranks (DDP, gloo); steps {WARM}-{STEPS}, "
          f"fastest of {args.rounds}" + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    for which in kinds:
        print(f"{KINDS[which]:24s}: {results[which] * 1e3:8.3f} ms/step  {results[which] / results['hand']:.3f} x hand")
    print("target: polytrain Trainer <= 1.02 x hand, and no slower than Fabric")
    # the same figures paired: each run against the hand loop's run of the same round (neighbours in time share
    # the machine's state), their median and range show how much of a difference the noise allows
    print(f"paired by round, median [min, max] of x hand over {args.rounds} rounds:")
    for which in kinds:
        if which != "hand":
            ratios = sorted(t / h for t, h in zip(rounds[which], rounds["hand"]))
            print(f"{KINDS[which]:24s}: {statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]")


if __name__ == "__main__":
    main()

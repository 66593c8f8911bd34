"""Worker and model factory for ``test_sharded_nonfinite.py``: an Inf in one gradient element that only
one rank's shard holds.

``make`` (``model.name=sharded_nonfinite_worker:make``): a small MLP whose head adds +Inf to the gradient
of the last element of its bias — the model's last parameter — in the ``poison_at``-th training
backward on rank ``poison_rank``. The loss and every other gradient stay finite. The reduced gradient
of that element is Inf, and it lives in the last rank's shard only: FSDP2 shards each parameter along
dim 0, ZeRO-2 partitions the flattened parameters in order, and ZeRO-3 partitions each parameter's
elements in order, the last rank holding the tail each time. So no other rank sees it locally; only
the all-reduce of the "non-finite" flag tells them.

``python sharded_nonfinite_worker.py OUT KEY=VALUE...`` — every rank (under torchrun) trains the
Trainer on the spec defaults with those sets, progress lines from every rank (``--verbose``), and
writes ``OUT/rank<r>.json``: the steps it completed, a digest of the full weights after each, and
the training failure it stopped with (or null); its stderr goes to ``OUT/rank<r>.stderr``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from polytrain import validation
from polytrain.checkpoint.store import state_digest
from polytrain.environments import detect_world
from polytrain.errors import TrainingFailure
from polytrain.train.callbacks import RunInfo
from polytrain.train.trainer import Trainer


class _InfInLastGradElement(torch.autograd.Function):
    """Identity forward; backward sets the last element of the incoming gradient to +Inf."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[-1] = float("inf")
        return grad


class PoisonedHead(nn.Linear):
    """A Linear layer that can poison its bias gradient; inside its own forward so that ZeRO-3 has
    gathered its parameters (FSDP2 has unsharded them) by then."""

    poison_next = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _InfInLastGradElement.apply(self.bias) if self.poison_next else self.bias
        return F.linear(x, self.weight, bias)


class PoisonedMLP(nn.Module):
    def __init__(self, in_features: int, outputs: int, poison_at: int, poison_rank: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU())
        self.head = PoisonedHead(32, outputs)
        self.poison_at, self.poison_rank = poison_at, poison_rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        rank = int(os.environ.get("RANK", "0"))
        self.head.poison_next = self.training and self.calls == self.poison_at and rank == self.poison_rank
        return self.head(self.body(x.flatten(1)))


def make(info: Any, poison_at: int, poison_rank: int) -> nn.Module:
    return PoisonedMLP(int(torch.tensor(info.input_shape).prod()), info.num_outputs, poison_at, poison_rank)


class WeightsAfterEachStep:
    """A callback: the digest of the full (gathered) weights after every step, on every rank."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.digests: dict[int, str] = {}

    def on_step_end(self, run: RunInfo, step: int, logs: dict[str, Any]) -> None:
        self.digests[step] = state_digest(self.trainer.framework.export_state())  # collective: every rank


def main(out: str, *sets: str) -> None:
    world = detect_world()
    with open(Path(out, f"rank{world.rank}.stderr"), "w") as log:  # this rank's own progress lines
        os.dup2(log.fileno(), 2)
    spec = validation.load(None, [*sets, f"output={out}"])
    recorder = WeightsAfterEachStep()
    trainer = Trainer(spec, world, show_progress=True, verbose=True, callbacks=[recorder])
    recorder.trainer = trainer
    error = None
    try:
        trainer.fit()
    except TrainingFailure as exc:
        error = str(exc)
    report = {"rank": world.rank, "steps": sorted(recorder.digests), "digests": recorder.digests, "error": error}
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])

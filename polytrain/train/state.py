"""What the Trainer keeps of a run: how its epochs cut into steps (`Steps`), where it stands (`Position`), the
loss since its last step record (`LossWindow`) and what it reached (`TrainResult`). Shared by the loop (`polytrain.train.trainer`) and its checkpoints
(`polytrain.train.checkpoints`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polytrain.protocols import DataShard
from polytrain.spec.tables import TrainSpec
from polytrain.train.schedule import lr_at


@dataclass
class TrainResult:
    """What a run reached, in plain Python numbers (``float`` and ``int``, not numpy's scalars, so a printed result
    reads as numbers): its last step and finished epochs, the last logged train loss and the last evaluation,
    and ``history``, each evaluation's epoch record (as ``metrics.jsonl`` holds it)."""

    global_step: int = 0
    epochs_done: int = 0
    train_loss: float = math.nan
    val_loss: float = math.nan
    val_accuracy: float | None = None
    #: the last evaluation's metrics by name (``accuracy``, ``mae``, a user function's name, ...)
    val_metrics: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False
    samples_per_s: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    #: the trained model, a plain one on the CPU that outlives the job (see the framework's ``release``)
    model: Any = field(default=None, repr=False, compare=False)


@dataclass
class Position:
    """Where training stands: the next step to run, its epoch and index within the epoch."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass(frozen=True)
class Steps:
    """How a run's epochs cut into optimizer steps, and the learning rate of each."""

    #: the part of the data this rank reads; its ``count`` (the data-parallel degree) plans batches and scales
    #: losses and the learning rate
    shard: DataShard
    #: samples per optimizer step, over all shards
    global_batch: int
    per_epoch: int
    #: ``loop.epochs``, ``loop.max_steps``
    epochs: int
    max_steps: int | None = None
    #: global step − (epoch × steps per epoch + step in the epoch): not 0 once the steps per epoch changed
    #: (data accepted as changed, another global batch at an epoch boundary); the schedule's horizon and the
    #: last step move by it, so every remaining epoch is trained in full
    offset: int = 0

    @property
    def horizon(self) -> int:
        """The schedule's horizon: every step of ``loop.epochs``. ``loop.max_steps`` stops a run early without
        compressing the schedule, so a run stopped there and resumed without it follows the straight run's
        learning rates exactly."""
        return self.per_epoch * self.epochs + self.offset

    @property
    def total(self) -> int:
        """Where this run stops: the end of ``loop.epochs``, or ``loop.max_steps`` when that comes first."""
        return min(self.horizon, self.max_steps or self.horizon)

    def lr(self, step: int, spec: TrainSpec) -> float:
        """The learning rate of ``step`` (0-based), scaled by the number of data shards."""
        return lr_at(step, optimizer=spec.optimizer, schedule=spec.schedule, world_size=self.shard.count,
                     steps_per_epoch=self.per_epoch, total_steps=self.horizon)


class LossWindow:
    """The losses summed since the last step record, their samples, and when the window opened; the third sum
    counts the ranks asked to stop (`polytrain.train.preemption`), set when the window closes."""

    def __init__(self) -> None:
        self.sums = np.zeros(3)
        self.opened = time.perf_counter()
        self.pending: Callable[[], np.ndarray] = lambda: self.sums  # the reduced sums, once a step closes it

    def reset(self) -> None:
        self.sums[:] = 0
        self.opened = time.perf_counter()

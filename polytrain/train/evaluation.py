"""The Trainer's evaluation of a validation set spread over the ranks: each evaluates its shard, and the sums are
reduced before dividing, so any world size reports what one process does."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from polytrain.data import Data, eval_shard
from polytrain.protocols import Backend, DataShard, Framework
from polytrain.spec import objectives
from polytrain.spec.tables import TrainSpec


def evaluate(framework: Framework, backend: Backend, prefetcher: Any, data: Data, spec: TrainSpec, shard: DataShard,
             epoch: int) -> tuple[float, dict[str, float]]:
    """Each rank evaluates its shard in the same number of batches; the (sum, count) pair of the loss and of every
    metric is all-reduced before dividing (`polytrain.spec.objectives.reduce`). Returns the loss and the metrics."""
    metrics = objectives.metric_names(spec.metrics, data.info.task)
    names = ("loss", *objectives.computed(metrics))
    mine = eval_shard(len(data.val), shard.count, shard.index)
    n_batches = max(1, math.ceil(math.ceil(len(data.val) / shard.count) / spec.data.batch_size))
    totals = np.zeros((len(names), 2))
    for x, y in prefetcher.batches(data.val, np.array_split(mine, n_batches), epoch):
        batch_totals = framework.evaluate(x, y)  # every rank: a layout's forward is collective
        if shard.reports:
            totals += [batch_totals[name] for name in names]
    reduced = backend.all_reduce(totals.reshape(-1)).reshape(len(names), 2)
    return objectives.reduce(dict(zip(names, map(tuple, reduced))), metrics)

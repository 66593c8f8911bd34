"""The per-rank plan of which samples each optimizer step uses, for every source alike.

Every framework and every source goes through the same plan, so PyTorch and TensorFlow runs of
one spec see the same samples in the same order, every sample is used exactly once per epoch at
any world size, and a checkpoint's (epoch, step in the epoch) is a complete data position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from polytrain.errors import SpecError


@dataclass(frozen=True)
class StepPlan:
    """This rank's micro-batches for one optimizer step, and the step's global sample count."""

    micro_batches: list[np.ndarray]
    global_count: int


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of ``n`` samples: the first ``val_fraction`` of a permutation seeded
    with ``seed`` are held out. The one split rule of every source."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    if n_val == n:
        raise SpecError(f"data.val_fraction: {val_fraction} leaves no training samples")
    return order[n_val:], order[:n_val]


def global_batch_size(batch_size: int, world_size: int, accum: int, fixed: int | None = None) -> int:
    """Samples per optimizer step: ``fixed`` (``data.global_batch_size``) when set, else batch_size × world
    size × accumulation."""
    return fixed or batch_size * world_size * accum


def steps_per_epoch(n_train: int, global_batch: int) -> int:
    return math.ceil(n_train / global_batch)


def shuffled(n: int, seed: int, epoch: int) -> np.ndarray:
    """The default sample order of an epoch: a permutation of ``range(n)`` that depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def epoch_plan(n_train: int, *, seed: int, epoch: int, global_batch: int, world_size: int, rank: int,
               accum: int, start_step: int = 0, order: np.ndarray | None = None) -> Iterator[StepPlan]:
    """The steps of one epoch for one rank.

    The epoch's order is the source's (``order``, a permutation of ``range(n_train)`` that depends
    only on (seed, epoch)) or `shuffled`; each step takes the next ``global_batch`` samples of it,
    splits them evenly across ranks and then across micro-steps. Every training sample is used
    exactly once per epoch; the last step may be smaller (some ranks may then have empty
    micro-batches).
    """
    if order is None:
        order = shuffled(n_train, seed, epoch)
    for step in range(start_step, steps_per_epoch(n_train, global_batch)):
        chunk = order[step * global_batch:(step + 1) * global_batch]
        mine = part(chunk, world_size, rank)
        yield StepPlan(micro_batches=[part(mine, accum, m) for m in range(accum)], global_count=len(chunk))


def part(items: np.ndarray, parts: int, index: int) -> np.ndarray:
    """Part ``index`` of ``items`` cut into ``parts`` (a view): ``np.array_split(items, parts)[index]``, the
    first ``len % parts`` parts one longer, without making the other parts (the step's plan, every step)."""
    size, longer = divmod(len(items), parts)
    start = index * size + min(index, longer)
    return items[start:start + size + (index < longer)]


def eval_shard(n: int, world_size: int, rank: int) -> np.ndarray:
    """The validation indices this rank evaluates (contiguous, together exactly all of them)."""
    return np.array_split(np.arange(n), world_size)[rank]

"""Shared checks of the file-backed sources: exactly once per epoch across ranks and micro-steps."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np
import pytest

from polytrain.data.plan import epoch_plan
from polytrain.data.source import Source

SampleIds = Callable[[np.ndarray, np.ndarray], np.ndarray]


def epoch_ids(source: Source, sample_ids: SampleIds, *, world: int, accum: int, batch: int, seed: int,
              epoch: int, global_batch: int | None = None) -> list[int]:
    """The sample ids every rank reads in one epoch, step by step, as the Trainer's plan hands them out
    (``global_batch``: data.global_batch_size; default batch × world × accum)."""
    order = source.order(seed, epoch)
    seen: list[int] = []
    for rank in range(world):
        for plan in epoch_plan(len(source), seed=seed, epoch=epoch, global_batch=global_batch or batch * world * accum,
                               world_size=world, rank=rank, accum=accum, order=order):
            for micro in plan.micro_batches:
                if len(micro):
                    x, y = source.read(micro)
                    assert len(x) == len(y) == len(micro)
                    seen += sample_ids(x, y).tolist()
    return seen


def check_exactly_once(source: Source, sample_ids: SampleIds, expected: list[int], batch: int = 5) -> None:
    """Every id in ``expected`` exactly once per epoch at world sizes 1-3 and accumulation 1-2; the order a
    function of (seed, epoch) only; a pickled copy reads the same."""
    for world in (1, 2, 3):
        for accum in (1, 2):
            for global_batch in (None, *uneven_global_batches(len(source), world * accum)):
                seen = epoch_ids(source, sample_ids, world=world, accum=accum, batch=batch, seed=7, epoch=1,
                                 global_batch=global_batch)
                assert sorted(seen) == sorted(expected), (world, accum, global_batch)
    copy = pickle.loads(pickle.dumps(source))  # a process-based reader would get such a copy
    for a, b in zip(source.read(source.order(7, 1)[:9]), copy.read(source.order(7, 1)[:9])):
        np.testing.assert_array_equal(a, b)
    first = source.order(7, 1)
    assert sorted(first.tolist()) == list(range(len(source)))
    assert np.array_equal(first, source.order(7, 1))
    assert not np.array_equal(first, source.order(7, 2))
    assert not np.array_equal(first, source.order(8, 1))


def uneven_global_batches(n: int, parts: int) -> list[int]:
    """Two global batches (data.global_batch_size) of an ``n``-sample epoch that ``parts`` (world size ×
    accumulation) divides neither, nor the epoch's last, partial step: ranks and micro-steps get unequal shares."""
    return [g for g in range(parts + 1, n) if g % parts and n % g % parts][:2]


@pytest.fixture
def exactly_once() -> Callable[..., None]:
    return check_exactly_once

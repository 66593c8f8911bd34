"""The data plan when nothing divides evenly (issue 26 item 17): a global batch (``data.global_batch_size``) that
world size × accumulation does not divide, an epoch whose last, partial step it does not divide either, and a
stop mid-epoch resumed at another world size. Every sample once per epoch, every step the same samples at any
world size and accumulation, the shares of ranks and micro-steps within one sample of each other."""

from __future__ import annotations

import numpy as np
import pytest

from polytrain.data import epoch_plan, steps_per_epoch

#: (training samples, global batch): 7 and 11 are prime; 100 % 7 = 2, 100 % 11 = 1, 61 % 7 = 5, 61 % 11 = 6
CASES = [(100, 7), (100, 11), (61, 7), (61, 11), (5, 7)]
SPLITS = [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (4, 3)]  # (world size, accumulation)


def plans(n: int, global_batch: int, world: int, accum: int, start_step: int = 0) -> list[list[list[np.ndarray]]]:
    """[rank][step] → that rank's micro-batches, from ``start_step`` to the end of the epoch."""
    return [[plan.micro_batches for plan in epoch_plan(n, seed=5, epoch=2, global_batch=global_batch,
                                                       world_size=world, rank=rank, accum=accum,
                                                       start_step=start_step)]
            for rank in range(world)]


def step_sets(per_rank: list[list[list[np.ndarray]]]) -> list[set[int]]:
    """The samples of each step, all ranks and micro-steps together."""
    return [set(np.concatenate([m for rank in per_rank for m in rank[step]]).tolist())
            for step in range(len(per_rank[0]))]


@pytest.mark.parametrize(("n", "global_batch"), CASES)
@pytest.mark.parametrize(("world", "accum"), SPLITS)
def test_uneven_steps_use_every_sample_once_and_the_same_samples_at_any_split(n: int, global_batch: int, world: int,
                                                                               accum: int) -> None:
    per_rank = plans(n, global_batch, world, accum)
    everything = [i for rank in per_rank for step in rank for micro in step for i in micro.tolist()]
    assert sorted(everything) == list(range(n))  # once each, nothing dropped by the remainders
    assert all(len(rank) == steps_per_epoch(n, global_batch) for rank in per_rank)
    assert step_sets(per_rank) == step_sets(plans(n, global_batch, 1, 1))  # the split does not change a step
    for step in range(steps_per_epoch(n, global_batch)):
        shares = [sum(len(m) for m in rank[step]) for rank in per_rank]
        micro = [len(m) for rank in per_rank for m in rank[step]]
        assert max(shares) - min(shares) <= 1 and max(micro) - min(micro) <= 1, (step, shares, micro)


@pytest.mark.parametrize(("n", "global_batch"), CASES[:4])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 3), (3, 2), (1, 4)])
def test_a_stop_mid_epoch_resumed_at_another_world_size_takes_the_rest_once(n: int, global_batch: int, before: int,
                                                                          after: int) -> None:
    """Stopped after ``stop`` steps on ``before`` ranks, resumed from the same position on ``after`` ranks (the
    checkpoint's step in the epoch; the same global batch, as `RunCheckpoints._restore` requires)."""
    stop = steps_per_epoch(n, global_batch) // 2
    done = step_sets(plans(n, global_batch, before, 2))[:stop]
    rest = step_sets(plans(n, global_batch, after, 1, start_step=stop))
    assert done + rest == step_sets(plans(n, global_batch, 1, 1))  # the straight run's steps, in order
    assert sorted(i for step in done + rest for i in step) == list(range(n))

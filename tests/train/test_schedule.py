from __future__ import annotations

import math

import pytest

from polytrain.spec.tables import OptimizerSpec, ScheduleSpec
from polytrain.train.schedule import lr_at


def lrs(schedule: ScheduleSpec, world: int = 4, per_epoch: int = 10, total: int = 50) -> list[float]:
    opt = OptimizerSpec(lr=0.1)
    return [lr_at(s, optimizer=opt, schedule=schedule, world_size=world, steps_per_epoch=per_epoch,
                  total_steps=total) for s in range(total)]


@pytest.mark.parametrize("mode,peak", [("linear", 0.4), ("sqrt", 0.2), ("none", 0.1)])
def test_scaling(mode: str, peak: float) -> None:
    assert lrs(ScheduleSpec(lr_scaling=mode)) == pytest.approx([peak] * 50)


def test_warmup_then_cosine() -> None:
    values = lrs(ScheduleSpec(lr_scaling="linear", warmup_epochs=1, decay="cosine", min_lr=0.01))
    assert values[0] == pytest.approx(0.04) and values[9] == pytest.approx(0.4)
    assert values[10] == pytest.approx(0.4)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    mid = 10 + 20
    assert values[mid] == pytest.approx(0.01 + 0.39 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_step_decay() -> None:
    values = lrs(ScheduleSpec(decay="step", step_epochs=2, gamma=0.5), world=1)
    assert values[19] == pytest.approx(0.1) and values[20] == pytest.approx(0.05) and values[49] == pytest.approx(0.025)

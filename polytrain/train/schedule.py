"""Learning rate as a pure function of the step: scaling by world size, warm-up, decay.

Definitions (the same for every framework):
- peak = optimizer.lr × scale, scale = world size (``linear``), √(world size) (``sqrt``) or 1.
- warm-up: for the first ``warmup_epochs × steps_per_epoch`` steps the rate rises
  linearly from peak / warmup_steps to peak (step k uses peak × (k + 1) / warmup_steps).
- then ``cosine`` decays from peak to ``min_lr`` over the remaining steps, ``step``
  multiplies by ``gamma`` every ``step_epochs`` epochs, ``none`` keeps the peak.
"""

from __future__ import annotations

import math

from polytrain.spec.tables import OptimizerSpec, ScheduleSpec


def scale_factor(mode: str, world_size: int) -> float:
    return {"linear": float(world_size), "sqrt": math.sqrt(world_size), "none": 1.0}[mode]


def lr_at(step: int, *, optimizer: OptimizerSpec, schedule: ScheduleSpec, world_size: int,
          steps_per_epoch: int, total_steps: int) -> float:
    peak = optimizer.lr * scale_factor(schedule.lr_scaling, world_size)
    warmup = int(round(schedule.warmup_epochs * steps_per_epoch))
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.decay == "cosine":
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return schedule.min_lr + (peak - schedule.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.decay == "step":
        epoch = step // max(1, steps_per_epoch)
        return max(schedule.min_lr, peak * schedule.gamma ** (epoch // schedule.step_epochs))
    return peak

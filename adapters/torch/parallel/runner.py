"""Running the pipeline: ``torch.distributed.pipelining`` stages and schedules, one per batch shape.

A `PipelineStage` learns the shapes it sends and receives on its first step; a batch of another size (an
epoch's last, smaller step, or a validation batch) gets a stage and schedule of its own, built once and kept,
cut into equal micro-batches (the most, up to ``parallel.microbatches``, that divide it).
Every stage's forward and backward of every micro-batch is a span on the timeline (track ``pipeline stages``, with its stage), and
the idle time between them within a step is recorded as ``bubble`` spans — what `bench/pipeline_bubble.py`
measures against the theoretical (P − 1) / (M + P − 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
)

from polytrain.adapters.torch.parallel.pipeline import StageModule
from polytrain.observe.timeline import PIPELINE, PIPELINE_IDLE, Timeline
from polytrain.spec.layout import MULTI_CHUNK, V_SHAPED

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}


def least_microbatches(kind: str, pipeline: int) -> int:
    """The fewest micro-batches a schedule runs its steady state with; a batch cut into fewer (an epoch's smaller
    last step) runs all forwards, then all backwards, instead."""
    return {"gpipe": 1, "zbv": 2 * pipeline - 1, "dualpipev": 2 * pipeline}.get(kind, pipeline)


class ScheduleVLoopedBFS(ScheduleLoopedBFS):
    """Looped BFS over V-shaped stages (rank r runs stages r and 2P − 1 − r): every forward of the rank's first
    stage, then of its second, then the backwards in reverse — for forward-only passes and for batches too small
    for ZBV or DualPipeV. torch takes the stage-to-rank map from these actions."""

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        stages = (rank, 2 * self.pp_group_size - 1 - rank)
        ops: list[_Action | None] = [_Action(stage, _ComputationType.FORWARD, mb)
                                     for stage in stages for mb in range(self._n_microbatches)]
        return ops + [_Action(stage, _ComputationType.FULL_BACKWARD, mb)
                      for stage in reversed(stages) for mb in reversed(range(self._n_microbatches))]


def microbatch_count(samples: int, most: int) -> int:
    """How many pipeline micro-batches a batch of ``samples`` is cut into: a stage learns one micro-batch shape, so
    they are equal, the most up to ``most`` (parallel.microbatches) that divide it (an epoch's smaller last step or a
    validation batch may get fewer)."""
    return max(d for d in range(1, max(1, min(most, samples)) + 1) if samples % d == 0)


class TimedStage(PipelineStage):
    """A `PipelineStage` that records each micro-batch's forward and backward on the timeline."""

    def __init__(self, *args: Any, timeline: Timeline, spans: list[tuple[float, float]], train: bool,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeline, self._spans, self._train = timeline, spans, train

    def _timed(self, what: str, chunk: int, run: Callable[[], Any]) -> Any:
        if not self._timeline.enabled:  # no timeline asked for: nothing to record per micro-batch
            return run()
        started = self._timeline.now()
        out = run()
        ended = self._timeline.now()
        self._spans.append((started, ended))
        self._timeline.complete(what, "pipeline", started, ended, track=PIPELINE,
                                stage=self.stage_index, micro=chunk)
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("forward", fwd_chunk_id, lambda: super(TimedStage, self).forward_one_chunk(
            fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not self._train:  # a forward-only schedule still calls it (and it returns at once): no span
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        # a zero-bubble schedule's input half (full_backward=False); its weight half is the next method
        return self._timed("backward", bwd_chunk_id, lambda: super(TimedStage, self).backward_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def get_local_bwd_output(self, mb_index: int) -> Any:
        # forward only, a V-shaped layout's two stages on one rank: the runtime still hands a backward's output
        # from one to the other, and there is none
        return super().get_local_bwd_output(mb_index) if self._train else None

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self._train:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("backward (weights)", bwd_chunk_id, lambda: super(
            TimedStage, self).backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs))


class PipelineRunner:
    """This rank's stages and their schedules (see the module's docstring)."""

    def __init__(self, stages: list[tuple[int, StageModule]], total: int, schedule: str, microbatches: int,
                 device: torch.device, group: Any, timeline: Timeline) -> None:
        self.stages, self.total, self.kind, self.microbatches = stages, total, schedule, microbatches
        self.device, self.group, self.timeline = device, group, timeline
        self.first = any(index == 0 for index, _ in stages)
        self.last = any(index == total - 1 for index, _ in stages)
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._spans: list[tuple[float, float]] = []
        self._loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _schedule(self, n: int, train: bool) -> Any:
        key = (n, train)
        if key not in self._schedules:
            chunks = microbatch_count(n, self.microbatches)
            pipes = [TimedStage(module, index, self.total, self.device, group=self.group,
                                timeline=self.timeline, spans=self._spans, train=train)
                     for index, module in self.stages]
            loss = self._scaled_loss if train else None
            looped = self.kind in MULTI_CHUNK
            cls = SCHEDULES[self.kind]
            pipeline = self.total // len(self.stages)
            # forward only, or fewer micro-batches than the schedule needs: all forwards, then backwards
            if not train or chunks < least_microbatches(self.kind, pipeline) or (
                    self.kind == "interleaved_zero_bubble" and chunks % max(1, chunks // pipeline)):
                cls = ScheduleVLoopedBFS if self.kind in V_SHAPED else ScheduleLoopedBFS if looped else ScheduleGPipe
            target = pipes if looped else pipes[0]
            self._schedules[key] = cls(target, n_microbatches=chunks, loss_fn=loss, scale_grads=False)
        return self._schedules[key]

    def _scaled_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(out, target) * self._scale

    def train(self, x: torch.Tensor, y: torch.Tensor, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              scale: float, autocast: contextlib.AbstractContextManager[Any]) -> float:
        """One micro-step through the pipeline (forward and backward of every micro-batch); returns the summed
        loss of its samples on the last stage (0 elsewhere). Gradients accumulate in the stages' parameters."""
        self._loss, self._scale = loss_sum, scale
        schedule = self._schedule(len(x), train=True)
        args = (x,) if self.first else ()
        losses: list[torch.Tensor] = []
        self._spans.clear()
        started = self.timeline.now()
        with autocast:
            schedule.step(*args, target=y if self.last else None, losses=losses if self.last else None,
                          return_outputs=False)
        self._record_bubbles(started, self.timeline.now())
        # the micro-batches' scaled losses (a first step's shape inference calls the loss on empty tensors too)
        return float(sum(float(loss.detach()) for loss in losses)) / scale if losses else 0.0

    def forward(self, x: torch.Tensor, autocast: contextlib.AbstractContextManager[Any]) -> torch.Tensor | None:
        """The model's outputs for ``x`` on the last stage (None elsewhere); forward only."""
        schedule = self._schedule(len(x), train=False)
        args = (x,) if self.first else ()
        self._spans.clear()
        with autocast, torch.no_grad():
            out = schedule.eval(*args)
        return out if self.last else None

    def _record_bubbles(self, started: float, ended: float) -> None:
        if not self.timeline.enabled:
            return
        cursor = started
        for start, end in [*sorted(self._spans), (ended, ended)]:
            if start > cursor:
                self.timeline.complete("bubble", "pipeline", cursor, start, track=PIPELINE_IDLE)
            cursor = max(cursor, end)

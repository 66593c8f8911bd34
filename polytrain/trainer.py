"""The framework-neutral training loop.

It talks only to a framework adapter (model, micro-steps) and a backend (collectives),
both made by the registry from the spec; it sees numpy arrays and floats.

Gradient averaging is exact for any split of a step's samples: each micro-batch's
backward uses ``sum of sample losses × world_size / global_count``; backends average
gradients over ranks, so the applied gradient is the mean over the step's samples —
the same as one process taking the whole global batch.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polytrain import checkpoint as ckpt
from polytrain import objectives, registry
from polytrain.data import Data, epoch_plan, eval_shard, global_batch_size, steps_per_epoch
from polytrain.data.prefetch import Prefetcher, load_transform
from polytrain.environments import detect_world
from polytrain.errors import TrainingFailure, UserError
from polytrain.failures import (
    check_ranks_agree,
    check_writable_dir,
    is_peer_failure,
    library_versions,
    peer_failure_detail,
    settled,
)
from polytrain.metrics import MetricsLog, Progress
from polytrain.protocols import BackendFactory, FrameworkFactory, data_shard_of
from polytrain.schedule import lr_at
from polytrain.spec import TrainSpec
from polytrain.timeline import NULL, Timeline, write_chrome_trace
from polytrain.trainer_state import Position, TrainerCheckpoints, TrainResult
from polytrain.watchdog import Activity, StallWatchdog
from polytrain.world import World


class Trainer(TrainerCheckpoints):
    def __init__(self, spec: TrainSpec, world: World | None = None, *, show_progress: bool = True,
                 resume: str | None = None, timeline: str | None = None, verbose: bool = False,
                 backend_factory: BackendFactory = registry.create_backend,
                 framework_factory: FrameworkFactory = registry.create_framework, data: Data | None = None,
                 callbacks: Sequence[Any] = ()) -> None:
        """``timeline``: a file to write a Chrome-trace timeline of every rank into (see polytrain.timeline);
        ``verbose``: every rank shows its progress (prefixed with its rank), not only rank 0;
        ``backend_factory``/``framework_factory``: what makes the two adapters (the registry's resolvers;
        anything that builds a `polytrain.protocols.Backend`/`Framework`, such as a test's fakes);
        ``data``: the samples to train on (default: the spec's data source, opened by the registry);
        ``callbacks``: callback objects, called after those the spec names (see polytrain.callbacks)."""
        self.backend_factory, self.framework_factory, self.data = backend_factory, framework_factory, data
        self.extra_callbacks = list(callbacks)
        self.spec = spec
        self.world = world if world is not None else detect_world()
        self.show_progress = show_progress
        self.resume = resume
        self.timeline_path = timeline
        self.verbose = verbose
        self._last_saved: int | None = None
        self._activity = Activity()

    def fit(self) -> TrainResult:
        spec, world = self.spec, self.world
        self.timeline = Timeline(world.rank) if self.timeline_path else NULL
        self.backend = self.backend_factory(spec, world, timeline=self.timeline, activity=self._activity)
        self.watchdog: StallWatchdog | None = None
        self.prefetcher: Prefetcher | None = None
        self.log = MetricsLog(None)
        is_main = world.rank == 0
        try:  # from here on the backend is torn down whatever happens (a failed setup included)
            self.backend.setup()
            # rank 0 alone makes the output directory: every rank learns at once if it cannot (not at a timeout)
            settled(self.backend, world.size, lambda: check_writable_dir("output", Path(spec.output)) if is_main
                    else None)
            self.log = MetricsLog(Path(spec.output) / "metrics.jsonl" if is_main else None)
            prefix = f"[rank {world.rank}] " if self.verbose and world.size > 1 else ""
            self.progress = Progress(enabled=(is_main or self.verbose) and self.show_progress, prefix=prefix)
            data = self.data if self.data is not None else registry.open_data(spec)
            self.prefetcher = Prefetcher(spec.data.workers, spec.data.prefetch, spec.seed, augment=data.augment,
                                         transform=load_transform(spec.data.transform))
            self._set_up_callbacks(data)
            self.framework = self.framework_factory(spec, world, self.backend)
            check = spec.reliability.startup_check and world.size > 1
            if check:  # before building: a wrapper like DDP would fail on mismatched models with less to say
                check_ranks_agree(self.backend, {"spec digest": spec.digest(), "library versions": library_versions()})
            self.framework.build(data.info)
            if check:
                shapes = sorted(self.framework.parameter_shapes().items())
                check_ranks_agree(self.backend, {"parameters": hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]})
            if self.backend.listen_address:
                self.progress.line(f"polytrain: rendezvous listens on {self.backend.listen_address}")
                self.log.write("rendezvous", listen=self.backend.listen_address)
            self.progress.line(
                f"polytrain: {spec.framework}/{self.backend.label} on {world.size} "
                f"process(es) "
                f"(launcher: {world.launcher}); {len(data.train)} training samples, "
                f"{len(data.val)} validation samples")
            # model-parallel layouts: the ranks of a tensor/pipeline group share one shard of the data
            self.shard = data_shard_of(self.backend, world)
            self.global_batch = global_batch_size(spec.data, self.shard.count, spec.loop.grad_accum_steps)
            self.per_epoch = steps_per_epoch(len(data.train), self.global_batch)
            start = self._restore() if self._resume_target() else Position()
            if self.timeline.enabled:
                self.backend.barrier()  # every rank's time zero is the same moment
                self.timeline.reset_origin()
            self._activity.set("the start of the training loop")  # the stall clock starts now, not at start-up
            self.watchdog = self._start_watchdog()  # from here on every rank runs the same activities
            try:
                result = self._loop(data, start)
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                detail = peer_failure_detail(exc)
                raise TrainingFailure(
                    f"rank {world.rank}: a collective failed during {self._activity.text}: {self._who_was_lost()} "
                    f"({detail})") from exc
            self._save_model(result)
            self._write_timeline()
            self.callbacks.call("on_train_end", result)
            return result
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.log.close()
            if self.prefetcher is not None:
                self.prefetcher.close()
            self.backend.teardown()

    # ------------------------------------------------------------------ the loop
    def _loop(self, data: Data, start: Position) -> TrainResult:
        spec, fw, loop, shard = self.spec, self.framework, self.spec.loop, self.shard
        timeline = self.timeline
        counts = 1.0 if shard.reports else 0.0  # the logged loss counts each shard once
        per_epoch = self.per_epoch
        total = self._total_steps()
        every_steps, every_epochs = spec.checkpoint.every_n_steps, spec.checkpoint.every_n_epochs
        verify_every = spec.reliability.verify_every_n_steps
        # fp16 runs skip overflowing steps through their loss scaler instead.
        self.check_finite = spec.precision != "fp16"
        result = TrainResult(global_step=start.step, epochs_done=start.epoch)
        step = start.step
        here = Position(start.step, start.epoch, start.step_in_epoch)  # where the loop stands, for saves
        self.callbacks.call("on_train_start")
        for epoch in range(start.epoch, loop.epochs):
            if step >= total or self.stopped_early:
                break
            first = start.step_in_epoch if epoch == start.epoch else 0
            self.progress.start_epoch(epoch, loop.epochs, min(per_epoch, first + total - step))
            window = np.zeros(2)  # summed loss, samples since the last report
            window_start = time.perf_counter()
            plans = epoch_plan(len(data.train), seed=spec.seed, epoch=epoch, global_batch=self.global_batch,
                               world_size=shard.count, rank=shard.index, accum=loop.grad_accum_steps,
                               start_step=first, order=data.train.order(spec.seed, epoch))
            batches = self.prefetcher.steps(data.train, enumerate(plans, start=first), epoch)
            for i in range(first, per_epoch):
                if step >= total:
                    break
                self._activity.set("reading data", step=step + 1)
                with timeline.span("data", "data", step=step + 1):
                    plan, micro_batches = next(batches)
                self._activity.set("forward/backward", step=step + 1)
                scale = shard.count / plan.global_count
                last = len(micro_batches) - 1
                for m, (x, y) in enumerate(micro_batches):
                    with timeline.span("micro-step", "compute", step=step + 1, micro=m, samples=len(x)):
                        loss_sum = fw.train_micro_step(x, y, scale, sync=m == last)
                    window += (loss_sum * counts, len(x) * counts)
                lr = lr_at(step, optimizer=spec.optimizer, schedule=spec.schedule, world_size=shard.count,
                           steps_per_epoch=per_epoch, total_steps=self._horizon())
                self._activity.set("the optimizer step", step=step + 1)
                with timeline.span("optimizer step", "optimizer", step=step + 1):
                    if self.check_finite and not fw.grads_finite():
                        self._nonfinite(step + 1)
                    else:
                        fw.optimizer_step(lr, loop.grad_clip_norm)
                step += 1
                if verify_every and step % verify_every == 0:
                    self._verify_replicas(step)
                here = Position(step, epoch, i + 1)
                logs: dict[str, Any] = {"epoch": epoch, "lr": lr}
                if step % loop.log_every_n_steps == 0 or i + 1 == per_epoch or step == total:
                    loss_total, count = self.backend.all_reduce(window)
                    elapsed = time.perf_counter() - window_start
                    loss = loss_total / max(count, 1)
                    speed = count / elapsed if elapsed > 0 else 0.0
                    self.log.write("step", step=step, epoch=epoch, loss=loss, lr=lr, samples_per_s=speed,
                                   **fw.step_stats())
                    self.progress.update(i + 1, loss, speed)
                    result.train_loss, result.samples_per_s = loss, speed
                    logs["loss"] = loss
                    window[:] = 0
                    window_start = time.perf_counter()
                self.callbacks.call("on_step_end", step, logs)
                if every_steps and step % every_steps == 0 and i + 1 < per_epoch:
                    self._save_checkpoint(here)
            batches.close()
            self.progress.end_epoch()
            complete = here.epoch == epoch and here.step_in_epoch == per_epoch
            stop = self._end_epoch(data, result, epoch, step, complete=complete)
            if complete:
                here = Position(step, epoch + 1, 0)
            self._save_best(here, result.history[-1])
            if not complete:  # stopped mid-epoch by loop.max_steps
                break
            if (every_epochs and (epoch + 1) % every_epochs == 0 or every_steps and step % every_steps == 0
                    or spec.checkpoint.save_last):
                self._save_checkpoint(here)
            if stop:
                self.progress.line(f"early stopping after epoch {epoch + 1}: {loop.early_stopping.monitor} has not "
                                   f"improved for {loop.early_stopping.patience} validation(s)")
                self.log.write("early_stopping", epoch=epoch, step=step)
                break
        if self.checkpointing and self._last_saved != step:  # always leave the final state resumable
            self._save_checkpoint(here)
        if not result.history:  # nothing left to train (a resumed finished run): evaluate what there is
            self._end_epoch(data, result, max(here.epoch - 1, 0), step, complete=True, decide=False)
        result.global_step = step
        result.stopped_early = self.stopped_early
        return result

    # ------------------------------------------------------------------ reliability
    def _who_was_lost(self) -> str:
        """Which ranks stopped responding (by their heartbeats), or the general cause when that is unknown."""
        lost = self.watchdog.lost_ranks() if self.watchdog is not None else None
        if lost:
            return "; ".join(f"rank {rank} stopped responding (last seen in {text})" for rank, text in lost.items())
        return "another rank died, stalled or lost its connection"

    def _start_watchdog(self) -> StallWatchdog | None:
        if self.world.size == 1:
            return None
        reliability = self.spec.reliability
        try:
            board = self.backend.progress_board()
        except (RuntimeError, OSError):  # no side channel (e.g. its store unreachable): warn without naming ranks
            board = None
        return StallWatchdog(self.world.rank, self.world.size, self._activity, reliability.stall_warning_s,
                             reliability.collective_timeout_s, board).start()

    def _nonfinite(self, step: int) -> None:
        policy = self.spec.reliability.on_nonfinite
        self.log.write("nonfinite", step=step, action=policy)
        if policy == "stop":
            raise TrainingFailure(f"step {step}: the loss or a gradient is NaN/Inf; stopped "
                                  f"(reliability.on_nonfinite: stop; 'skip' drops such steps instead)")
        self.framework.discard_gradients()
        self.progress.line(f"step {step}: the loss or a gradient is NaN/Inf; step skipped (on_nonfinite: skip)")

    def _verify_replicas(self, step: int) -> None:
        digests = self.backend.all_gather_object(ckpt.state_digest(self.framework.export_state()))
        drifted = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if drifted:
            raise TrainingFailure(f"step {step}: the weights of rank(s) {', '.join(map(str, drifted))} differ from "
                                  f"rank 0's (replicas drifted apart; reliability.verify_every_n_steps)")

    def _end_epoch(self, data: Data, result: TrainResult, epoch: int, step: int, complete: bool,
                   decide: bool = True) -> bool:
        """Evaluate, log and tell the callbacks; returns whether early stopping ends training now."""
        val_loss: float | None = None
        values: dict[str, float] = {}
        if len(data.val):  # with no validation data (data.val_fraction: 0) an epoch ends on its train loss
            with self.timeline.span("evaluation", "evaluation", epoch=epoch):
                val_loss, values = self._evaluate(data, epoch)
            result.val_loss, result.val_metrics = val_loss, values
            result.val_accuracy = values.get("accuracy")
        result.global_step, result.epochs_done = step, epoch + (1 if complete else 0)
        record = {"epoch": epoch, "step": step, "train_loss": result.train_loss, "val_loss": val_loss,
                  "val_accuracy": result.val_accuracy, **{f"val_{name}": value for name, value in values.items()}}
        result.history.append(record)
        self.log.write("epoch", **record)
        shown = "".join(f", val {name.replace('_', ' ')} {value:.4f}" for name, value in values.items())
        validated = f", val loss {val_loss:.4f}{shown}" if val_loss is not None else " (no validation data)"
        self.progress.line(f"epoch {epoch + 1}: train loss {result.train_loss:.4f}{validated}")
        self.callbacks.call("on_validation_end", epoch, record)
        if self.early_stopping is None or not decide:
            return False
        stop = self.early_stopping.update(record)
        self.stopped_early = bool(self.backend.broadcast_object(stop))  # rank 0's decision, on every rank
        return self.stopped_early

    def _evaluate(self, data: Data, epoch: int) -> tuple[float, dict[str, float]]:
        """Each rank evaluates its shard in the same number of batches; the (sum, count) pair of the loss
        and of every metric is all-reduced before dividing (`polytrain.objectives.reduce`)."""
        self._activity.set("evaluation")
        shard, batch = self.shard, self.spec.data.batch_size
        metrics = objectives.metric_names(self.spec.metrics, data.info.task)
        names = ("loss", *objectives.computed(metrics))
        mine = eval_shard(len(data.val), shard.count, shard.index)
        n_batches = max(1, math.ceil(math.ceil(len(data.val) / shard.count) / batch))
        totals = np.zeros((len(names), 2))
        for x, y in self.prefetcher.batches(data.val, np.array_split(mine, n_batches), epoch):
            batch_totals = self.framework.evaluate(x, y)  # every rank: a layout's forward is collective
            if shard.reports:
                totals += [batch_totals[name] for name in names]
        reduced = self.backend.all_reduce(totals.reshape(-1)).reshape(len(names), 2)
        return objectives.reduce(dict(zip(names, map(tuple, reduced))), metrics)

    # ------------------------------------------------------------------ checkpoints
    def _total_steps(self) -> int:
        """Where this run stops: the end of ``loop.epochs``, or ``loop.max_steps`` when that comes first."""
        loop = self.spec.loop
        return min(self._horizon(), loop.max_steps or self._horizon())

    def _horizon(self) -> int:
        """The schedule's horizon: every step of ``loop.epochs``. ``loop.max_steps`` stops a run early without
        compressing the schedule, so a run stopped there and resumed without it follows the straight run's
        learning rates exactly."""
        return self.per_epoch * self.spec.loop.epochs

    def _write_timeline(self) -> None:
        """Gather every rank's timeline events; rank 0 writes them as one Chrome trace."""
        if self.timeline.enabled:
            meta = {"framework": self.spec.framework, "backend": self.backend.name, "world_size": self.world.size,
                    "launcher": self.world.launcher}
            everyone = self.backend.all_gather_object(self.timeline.events)
            path = settled(self.backend, self.world.size, lambda: write_timeline_file(
                self.timeline_path, dict(enumerate(everyone)), meta) if self.world.rank == 0 else None)
            if self.world.rank == 0:
                self.progress.line(f"timeline: {path} (open in https://ui.perfetto.dev or chrome://tracing)")


def write_timeline_file(path: str, events_by_rank: dict[int, Any], meta: dict[str, Any]) -> Path:
    """Write the merged trace, or fail in one line naming --timeline (exit code 2)."""
    try:
        return write_chrome_trace(path, events_by_rank, metadata=meta)
    except OSError as exc:
        raise UserError(f"--timeline {path}: cannot write it ({exc.strerror or exc}); give a path in a writable "
                        f"directory") from None


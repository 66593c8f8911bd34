"""The framework-neutral training loop.

It talks only to a framework adapter (model, micro-steps) and a backend (collectives),
both made by the registry from the spec; it sees numpy arrays and floats.

Gradient averaging is exact for any split of a step's samples: each micro-batch's
backward uses ``sum of sample losses × shards / global_count`` (shards: the world size, or a
model-parallel layout's data dimension, `polytrain.protocols.DataShard`); backends average
gradients over ranks, so the applied gradient is the mean over the step's samples —
the same as one process taking the whole global batch.

Its checkpoints are `polytrain.train.checkpoints`, its callbacks `polytrain.train.callbacks`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from polytrain import registry
from polytrain.checkpoint import files as cf
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint.files import check_writable_dir
from polytrain.checkpoint.fingerprint import fingerprint
from polytrain.comm.agree import check_ranks_agree, check_replicas_agree, library_versions
from polytrain.comm.settle import settled
from polytrain.data import Data, StepPlan, epoch_plan, global_batch_size, steps_per_epoch
from polytrain.data.prefetch import Batch, Prefetcher, load_transform
from polytrain.environments import detect_world
from polytrain.errors import TrainingFailure, is_peer_failure, peer_failure_detail
from polytrain.observe.metrics import MetricsLog, Progress
from polytrain.observe.profiling import NO_PROFILER, Profiler, open_profiler
from polytrain.observe.timeline import NULL, Timeline, write_timeline_file
from polytrain.observe.trackers import Trackers, start_for_run
from polytrain.observe.watchdog import Activity, StallWatchdog, start_watchdog, who_was_lost
from polytrain.protocols import Backend, BackendFactory, Framework, FrameworkFactory
from polytrain.spec import objectives as objectives
from polytrain.spec.tables import TrainSpec
from polytrain.train.callbacks import RunHooks, set_up_callbacks
from polytrain.train.checkpoints import RunCheckpoints, Start
from polytrain.train.elastic import ElasticRun
from polytrain.train.evaluation import evaluate
from polytrain.train.preemption import NO_STOP, StepStop, start_stop
from polytrain.train.state import LossWindow, Position, Steps, TrainResult
from polytrain.world import World


class Trainer:
    """One training run of a spec: ``fit`` makes the backend, the data, the callbacks, the model and the run's
    checkpoints, trains epoch by epoch (`_epoch`) and step by step (`_step`), saves the final model, and ends
    everything it started (`_tear_down`)."""

    def __init__(self, spec: TrainSpec, world: World | None = None, *, show_progress: bool = True,
                 resume: str | None = None, timeline: str | None = None, verbose: bool = False,
                 backend_factory: BackendFactory = registry.create_backend,
                 framework_factory: FrameworkFactory = registry.create_framework, data: Data | None = None,
                 callbacks: Sequence[Any] = (), accept_changed_data: bool = False,
                 overwrite_checkpoints: bool = False) -> None:
        """``timeline``: a file to write a Chrome-trace timeline of every rank into (see polytrain.observe.timeline);
        ``verbose``: every rank shows its progress (prefixed with its rank), not only rank 0;
        ``backend_factory``/``framework_factory``: what makes the two adapters (the registry's resolvers;
        anything that builds a `polytrain.protocols.Backend`/`Framework`, such as a test's fakes);
        ``data``: the samples to train on (default: the spec's data source, opened by the registry);
        ``callbacks``: callback objects, called after those the spec names (see polytrain.train.callbacks);
        ``accept_changed_data``: resume although the data changed since the checkpoint, its epoch started over;
        ``overwrite_checkpoints``: move another run's checkpoints in checkpoint.dir aside instead of refusing."""
        self.spec = spec
        self.world = world if world is not None else detect_world()
        self.backend_factory, self.framework_factory, self.data = backend_factory, framework_factory, data
        self.extra_callbacks = list(callbacks)
        self.show_progress, self.verbose, self.timeline_path = show_progress, verbose, timeline
        self.resume = resume
        self.accept_changed_data = accept_changed_data
        self.overwrite_checkpoints = overwrite_checkpoints
        self.check_finite = spec.checks_finite
        self.activity = Activity()  # what this rank is doing now, for the stall watchdog and failure messages
        # the run's parts: `fit` makes them, and ends them (`_tear_down`) before it returns or raises
        self.timeline: Timeline = NULL
        self.backend: Backend | None = None
        self.log = MetricsLog(None)
        self.progress = Progress(enabled=False)
        self.prefetcher: Prefetcher | None = None
        self.hooks: RunHooks | None = None
        self.framework: Framework | None = None
        self.steps: Steps | None = None
        self.checkpoints: RunCheckpoints | None = None
        self.watchdog: StallWatchdog | None = None
        self.trackers = Trackers()  # rank 0's W&B/MLflow runs (logging.wandb, logging.mlflow), once started
        self.profiler: Profiler = NO_PROFILER
        self.elastic: ElasticRun | None = None  # under polytrain's elastic driver: commits, recovery in place
        self.stop: StepStop = NO_STOP  # the preemption table's: a signal stops the run at an agreed step

    def fit(self) -> TrainResult:
        spec, world = self.spec, self.world
        self.timeline = Timeline(world.rank) if self.timeline_path else NULL
        self.backend = self.backend_factory(spec, world, timeline=self.timeline, activity=self.activity)
        is_main = world.rank == 0
        try:  # from here on the backend is torn down whatever happens (a failed setup included)
            self.stop = start_stop(spec.preemption, world.rank, spec.checkpoint_dir)  # a signal in start-up counts
            self.backend.setup()  # then the watchdog: the ranks wait for a slow rank 0 by its heartbeat (settled)
            times = spec.reliability.stall_warning_s, spec.reliability.collective_timeout_s
            self.watchdog = start_watchdog(self.backend, world.rank, world.size, self.activity, *times,
                                           quiet_start=True)  # stall warnings from the training loop on
            # rank 0 alone makes the output directory: every rank learns at once if it cannot (not at a timeout)
            settled(self.backend, world.size, lambda: check_writable_dir("output", Path(spec.output)) if is_main
                    else None)
            self.log = MetricsLog(Path(spec.output) / "metrics.jsonl" if is_main else None,
                                  tensorboard=spec.logging.tensorboard, csv=spec.logging.csv)
            prefix = f"[rank {world.rank}] " if self.verbose and world.size > 1 else ""
            self.progress = Progress(enabled=(is_main or self.verbose) and self.show_progress, prefix=prefix)
            data = self.data if self.data is not None else registry.open_data(spec)
            self.prefetcher = Prefetcher(spec.data.workers, spec.data.prefetch, spec.seed, augment=data.augment,
                                         transform=load_transform(spec.data.transform))
            self.hooks = set_up_callbacks(spec, world, self.extra_callbacks, data.info.task, bool(len(data.val)),
                                          self.stop)
            self._build(data)
            start = self._begin(data)
            if not start.complete:  # rank 0's trackers (in the runs a resumed checkpoint kept), before training
                self.trackers = start_for_run(spec, world, self.backend, self.checkpoints.resumed_trackers)
                self.log.trackers = self.checkpoints.trackers = self.trackers  # run ids go into every checkpoint
                self.profiler = open_profiler(spec, world.rank, self.timeline)
            result = self._complete(data, start) if start.complete else self._train(data, start.position)
        except BaseException:
            self._tear_down(raising=True)
            raise
        self._tear_down(raising=False)
        return result

    def _train(self, data: Data, start: Position) -> TrainResult:
        """Train from ``start``, then write the final model and the timeline."""
        if self.backend.listen_address:
            self.log.write("rendezvous", listen=self.backend.listen_address)
        if self.timeline.enabled:
            self.backend.barrier()  # every rank's time zero is the same moment
            self.timeline.reset_origin()
        self.activity.set("the start of the training loop")  # the stall clock starts now, not at start-up
        try:
            self.elastic = ElasticRun.of(self)
            result = self.elastic.run(lambda at: self._loop(data, at), start) if self.elastic else self._loop(data, start)
            self.checkpoints.settle()  # the last background checkpoint write, done and known to every rank
            if self.stop.stopped:  # preempted: its checkpoint settled, no final model (the run goes on later)
                raise self.stop.end(self.checkpoints.last_saved)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            raise TrainingFailure(
                f"rank {self.world.rank}: a collective failed during {self.activity.text}: "
                f"{who_was_lost(self.watchdog)} ({peer_failure_detail(exc)})") from exc
        final_state = self.checkpoints.save_model(result)
        self.trackers.log_model([Path(self.spec.output) / name for name in (cf.MODEL_FILE, cf.MODEL_JSON)])
        self._write_timeline()
        self.hooks.callbacks.call("on_train_end", result)
        result.model = self.framework.release(final_state)
        return result

    def _complete(self, data: Data, start: Start) -> TrainResult:
        """A resumed run that was already complete (`Start.complete`): nothing is trained, written or called back;
        the result holds the checkpoint's step, finished epochs and model. Only a run that ended between its last
        checkpoint and its final model (a crash, a kill) gets that model now, evaluated as at its end."""
        pos = start.position
        result = TrainResult(global_step=pos.step, epochs_done=pos.epoch, stopped_early=self.hooks.stopped_early)
        state = self.framework.export_state() if self.checkpoints.model_written(pos.step) else None
        if state is None:
            if len(data.val):
                result.val_loss, result.val_metrics = self._evaluate(data, max(pos.epoch - 1, 0))
                result.val_accuracy = result.val_metrics.get("accuracy")
            state = self.checkpoints.save_model(result)
        result.model = self.framework.release(state)
        return result

    def _build(self, data: Data) -> None:
        """The framework adapter and its model, the ranks checked to agree before and after building; the
        start-up lines."""
        spec, world = self.spec, self.world
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
        self.progress.line(f"polytrain: {spec.framework}/{self.backend.label} on {world.size} process(es) (launcher: "
                           f"{world.launcher}); {len(data.train)} training samples, {len(data.val)} validation samples")

    def _begin(self, data: Data) -> Start:
        """How the epochs cut into steps, the run's checkpoints, and where it begins (a resume restores the
        checkpoint's state, and may find the run complete)."""
        spec, world = self.spec, self.world
        # model-parallel layouts: the ranks of a tensor/pipeline group share one shard of the data
        shard = self.backend.data_shard
        global_batch = global_batch_size(spec.data.batch_size, shard.count, spec.loop.grad_accum_steps,
                                         fixed=spec.data.global_batch_size)
        steps = Steps(shard, global_batch, steps_per_epoch(len(data.train), global_batch), spec.loop.epochs,
                      spec.loop.max_steps)
        # rank 0 records what the data is in every checkpoint, and checks a resumed checkpoint's against it
        dataset = settled(self.backend, world.size, lambda: fingerprint(spec.data, data) if world.rank == 0
                          else None)
        self.checkpoints = RunCheckpoints(spec, world, self.backend, self.framework, self.hooks, steps, dataset,
                                          log=self.log, progress=self.progress, timeline=self.timeline,
                                          activity=self.activity)
        start = self.checkpoints.begin(self.resume, accept_changed_data=self.accept_changed_data,
                                       overwrite=self.overwrite_checkpoints)
        self.steps = start.steps
        return start

    def _tear_down(self, raising: bool) -> None:
        """End everything `fit` started, users before what they use: a background checkpoint write, the watchdog,
        the log, the data threads, the framework's hold on the wrapped model (DDP, FSDP, DeepSpeed keep the process
        group through it), the backend's groups and stores (a live gloo thread at exit aborts the process). Every
        step runs; the first failure is raised afterwards, unless `fit` is already ``raising``."""
        ends = (self.checkpoints and self.checkpoints.abandon, self.stop.close, self.watchdog and self.watchdog.close,
                self.profiler.close, lambda: self.trackers.finish(failed=raising), self.log.close,
                self.prefetcher.close if self.prefetcher is not None else None,
                self.framework.release if self.framework is not None else None, self.backend.teardown)
        failure: Exception | None = None
        for end in ends:
            try:
                if end is not None:
                    end()
            except Exception as exc:  # noqa: BLE001 - the later steps still run
                failure = failure or exc
        if failure is not None and not raising:
            raise failure

    # ------------------------------------------------------------------ the loop
    def _loop(self, data: Data, start: Position) -> TrainResult:
        """Train from ``start`` to the run's last step (or early stopping), epoch by epoch; the final state is
        left resumable when the run writes checkpoints."""
        result = TrainResult(global_step=start.step, epochs_done=start.epoch)
        here = start  # where the loop stands, for saves
        self.hooks.callbacks.call("on_train_start")
        for epoch in range(start.epoch, self.spec.loop.epochs):
            if here.step >= self.steps.total or self.hooks.stopped_early or self.stop.due(here.step):
                break
            here, going_on = self._epoch(data, epoch, here, result)
            if not going_on:
                break
        if self.checkpoints.enabled and self.checkpoints.last_saved != here.step:
            self.checkpoints.save(here)  # always leave the final state resumable
        result.global_step = here.step
        result.stopped_early = self.hooks.stopped_early
        return result

    def _epoch(self, data: Data, epoch: int, here: Position, result: TrainResult) -> tuple[Position, bool]:
        """Epoch ``epoch`` from ``here`` (its first step, or where a resume left it): its steps, the evaluation at
        its end and the checkpoints due. Returns where the run stands and whether it goes on to the next epoch."""
        spec, loop, steps = self.spec, self.spec.loop, self.steps
        every_steps, every_epochs = spec.checkpoint.every_n_steps, spec.checkpoint.every_n_epochs
        first = here.step_in_epoch
        self.progress.start_epoch(epoch, loop.epochs, min(steps.per_epoch, first + steps.total - here.step))
        window = LossWindow()
        plans = epoch_plan(len(data.train), seed=spec.seed, epoch=epoch, global_batch=steps.global_batch,
                           world_size=steps.shard.count, rank=steps.shard.index, accum=loop.grad_accum_steps,
                           start_step=first, order=data.train.order(spec.seed, epoch))
        batches = self.prefetcher.steps(data.train, enumerate(plans, start=first), epoch)
        for i in range(first, steps.per_epoch):
            if here.step >= steps.total:
                break
            closes = (here.step + 1) % loop.log_every_n_steps == 0 or i + 1 == steps.per_epoch \
                or here.step + 1 == steps.total  # the logging window: its loss is reduced and written
            with self.profiler.step(here.step + 1):
                lr = self._step(here.step + 1, batches, window, closes)
            here = Position(here.step + 1, epoch, i + 1)
            logs: dict[str, Any] = {"epoch": epoch, "lr": lr}
            if closes:
                logs["loss"] = self._report(window, here, lr, result)
            self.hooks.callbacks.call("on_step_end", here.step, logs)
            if self.elastic is not None:
                self.elastic.after_step(here)
            if self.stop.due(here.step) and i + 1 < steps.per_epoch:  # preempted: `_loop` saves, no evaluation
                batches.close()
                self.progress.end_epoch()
                return here, False
            if every_steps and here.step % every_steps == 0 and i + 1 < steps.per_epoch:
                self.checkpoints.save(here)
        batches.close()
        self.progress.end_epoch()
        complete = here.epoch == epoch and here.step_in_epoch == steps.per_epoch
        stop = self._end_epoch(data, result, epoch, here.step, complete=complete)
        if complete:
            here = Position(here.step, epoch + 1, 0)
        self.checkpoints.save_best(here, result.history[-1])
        if not complete:  # stopped mid-epoch by loop.max_steps
            return here, False
        if (every_epochs and (epoch + 1) % every_epochs == 0 or every_steps and here.step % every_steps == 0
                or spec.checkpoint.save_last):
            self.checkpoints.save(here)
        if stop:
            self.progress.line(f"early stopping after epoch {epoch + 1}: {loop.early_stopping.monitor} has not "
                               f"improved for {loop.early_stopping.patience} validation(s)")
            self.log.write("early_stopping", epoch=epoch, step=here.step)
        return here, not stop

    def _step(self, number: int, batches: Iterator[tuple[StepPlan, list[Batch]]], window: LossWindow,
              closes: bool) -> float:
        """Optimizer step ``number`` (counted from 1): its micro-batches' forward and backward, then the update
        (or the reliability.on_nonfinite policy); where it ``closes`` the logging window, the window's sums are
        reduced across ranks meanwhile (`_report` takes them). Returns the step's learning rate."""
        fw, shard, timeline = self.framework, self.steps.shard, self.timeline
        counts = 1.0 if shard.reports else 0.0  # the logged loss counts each shard once
        self.activity.set("reading data", step=number)
        with timeline.span("data", "data", step=number):
            plan, micro_batches = next(batches)
        self.activity.set("forward/backward", step=number)
        scale = shard.count / plan.global_count
        last = len(micro_batches) - 1
        for m, (x, y) in enumerate(micro_batches):
            with timeline.span("micro-step", "compute", step=number, micro=m, samples=len(x)):
                loss_sum = fw.train_micro_step(x, y, scale, sync=m == last)
            window.sums[:2] += (loss_sum * counts, len(x) * counts)
        lr = self.steps.lr(number - 1, self.spec)
        self.activity.set("the optimizer step", step=number)
        if closes:  # the collective overlaps the optimizer step rather than adding its latency to the step; it
            window.sums[2] = self.stop.asked  # also counts the ranks asked to stop (`polytrain.train.preemption`)
            window.pending = self.backend.start_all_reduce(window.sums)
        with timeline.span("optimizer step", "optimizer", step=number):
            if self.check_finite and not fw.grads_finite():
                self._nonfinite(number)
            else:
                fw.optimizer_step(lr, self.spec.loop.grad_clip_norm)
        verify_every = self.spec.reliability.verify_every_n_steps
        if verify_every and number % verify_every == 0:
            check_replicas_agree(self.backend, ckpt.state_digest(self.framework.export_state()), number)
        return lr

    def _report(self, window: LossWindow, here: Position, lr: float, result: TrainResult) -> float:
        """Close the logging window at ``here``: its loss averaged over every shard's samples, the step record
        and the progress line. Returns the loss."""
        loss_total, count, signalled = window.pending()
        self.stop.heard(signalled, here.step)
        elapsed = time.perf_counter() - window.opened
        loss = float(loss_total / max(count, 1))  # plain Python numbers in records and the result, not numpy's
        speed = float(count / elapsed) if elapsed > 0 else 0.0
        self.log.write("step", step=here.step, epoch=here.epoch, loss=loss, lr=lr, samples_per_s=speed,
                       **self.framework.step_stats())
        self.progress.update(here.step_in_epoch, loss, speed)
        result.train_loss, result.samples_per_s = loss, speed
        window.reset()
        return loss

    def _end_epoch(self, data: Data, result: TrainResult, epoch: int, step: int, complete: bool) -> bool:
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
        self.hooks.callbacks.call("on_validation_end", epoch, record)
        stopping = self.hooks.early_stopping
        if stopping is None:
            return False
        stopping.stopped = bool(self.backend.broadcast_object(stopping.update(record)))  # rank 0's, on every rank
        return stopping.stopped

    def _evaluate(self, data: Data, epoch: int) -> tuple[float, dict[str, float]]:
        self.activity.set("evaluation")
        return evaluate(self.framework, self.backend, self.prefetcher, data, self.spec, self.steps.shard, epoch)

    # ------------------------------------------------------------------ reliability
    def _nonfinite(self, step: int) -> None:
        policy = self.spec.reliability.on_nonfinite
        self.log.write("nonfinite", step=step, action=policy)
        if policy == "stop":
            raise TrainingFailure(f"step {step}: the loss or a gradient is NaN/Inf; stopped "
                                  f"(reliability.on_nonfinite: stop; 'skip' drops such steps instead)")
        self.framework.discard_gradients()
        self.progress.line(f"step {step}: the loss or a gradient is NaN/Inf; step skipped (on_nonfinite: skip)")

    # ------------------------------------------------------------------ the timeline
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


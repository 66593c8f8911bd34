"""The framework-neutral training loop.

It talks only to a framework adapter (model, micro-steps) and a backend (collectives),
both made by the registry from the spec; it sees numpy arrays and floats.

Gradient averaging is exact for any split of a step's samples: each micro-batch's
backward uses ``sum of sample losses × world_size / global_count``; backends average
gradients over ranks, so the applied gradient is the mean over the step's samples —
the same as one process taking the whole global batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polytrain import registry
from polytrain.checkpoint import state_digest, write_model
from polytrain.data import Dataset, epoch_plan, eval_shard, load_dataset, steps_per_epoch
from polytrain.metrics import MetricsLog, Progress
from polytrain.schedule import lr_at
from polytrain.spec import TrainSpec
from polytrain.world import World, detect_world


@dataclass
class TrainResult:
    global_step: int = 0
    epochs_done: int = 0
    train_loss: float = math.nan
    val_loss: float = math.nan
    val_accuracy: float | None = None
    samples_per_s: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    def __init__(self, spec: TrainSpec, world: World | None = None, *, show_progress: bool = True) -> None:
        self.spec = spec
        self.world = world if world is not None else detect_world()
        self.show_progress = show_progress

    def fit(self) -> TrainResult:
        spec, world = self.spec, self.world
        self.backend = registry.create_backend(spec, world)
        self.backend.setup()
        is_main = world.rank == 0
        out_dir = Path(spec.output)
        self.log = MetricsLog(out_dir / "metrics.jsonl" if is_main else None)
        self.progress = Progress(enabled=is_main and self.show_progress)
        try:
            data = load_dataset(spec.data, spec.seed)
            self.framework = registry.create_framework(spec, world, self.backend)
            self.framework.build(data.info)
            self.progress.line(
                f"polytrain: {spec.framework}/{self.backend.name} on {world.size} process(es) "
                f"(launcher: {world.launcher}); {len(data.x_train)} training samples, "
                f"{len(data.x_val)} validation samples")
            result = self._loop(data)
            self._save(result)
            return result
        finally:
            self.log.close()
            self.backend.teardown()

    # ------------------------------------------------------------------ the loop
    def _loop(self, data: Dataset) -> TrainResult:
        spec, world, fw = self.spec, self.world, self.framework
        loop = spec.loop
        per_epoch = steps_per_epoch(len(data.x_train), spec.data.batch_size, world.size, loop.grad_accum_steps)
        total = per_epoch * loop.epochs if loop.max_steps is None else min(loop.max_steps, per_epoch * loop.epochs)
        result = TrainResult()
        step = 0
        for epoch in range(loop.epochs):
            if step >= total:
                break
            self.progress.start_epoch(epoch, loop.epochs, min(per_epoch, total - step))
            window = np.zeros(2)  # summed loss, samples since the last report
            window_start = time.perf_counter()
            for i, plan in enumerate(epoch_plan(
                    len(data.x_train), seed=spec.seed, epoch=epoch, batch_size=spec.data.batch_size,
                    world_size=world.size, rank=world.rank, accum=loop.grad_accum_steps)):
                if step >= total:
                    break
                scale = world.size / plan.global_count
                last = len(plan.micro_batches) - 1
                for m, idx in enumerate(plan.micro_batches):
                    loss_sum = fw.train_micro_step(data.x_train[idx], data.y_train[idx], scale, sync=m == last)
                    window += (loss_sum, len(idx))
                lr = lr_at(step, optimizer=spec.optimizer, schedule=spec.schedule, world_size=world.size,
                           steps_per_epoch=per_epoch, total_steps=total)
                fw.optimizer_step(lr, loop.grad_clip_norm)
                step += 1
                if step % loop.log_every_n_steps == 0 or i + 1 == per_epoch or step == total:
                    loss_total, count = self.backend.all_reduce(window)
                    elapsed = time.perf_counter() - window_start
                    loss = loss_total / max(count, 1)
                    speed = count / elapsed if elapsed > 0 else 0.0
                    self.log.write("step", step=step, epoch=epoch, loss=loss, lr=lr, samples_per_s=speed)
                    self.progress.update(i + 1, loss, speed)
                    result.train_loss, result.samples_per_s = loss, speed
                    window[:] = 0
                    window_start = time.perf_counter()
            self.progress.end_epoch()
            val_loss, val_acc = self._evaluate(data)
            result.global_step, result.epochs_done = step, epoch + 1
            result.val_loss, result.val_accuracy = val_loss, val_acc
            record = {"epoch": epoch, "step": step, "train_loss": result.train_loss, "val_loss": val_loss,
                      "val_accuracy": val_acc}
            result.history.append(record)
            self.log.write("epoch", **record)
            acc_text = f", val accuracy {val_acc:.4f}" if val_acc is not None else ""
            self.progress.line(f"epoch {epoch + 1}: train loss {result.train_loss:.4f}, val loss {val_loss:.4f}"
                               f"{acc_text}")
        return result

    def _evaluate(self, data: Dataset) -> tuple[float, float | None]:
        """Each rank evaluates its shard in the same number of batches; sums are all-reduced."""
        world, batch = self.world, self.spec.data.batch_size
        mine = eval_shard(len(data.x_val), world.size, world.rank)
        n_batches = max(1, math.ceil(math.ceil(len(data.x_val) / world.size) / batch))
        totals = np.zeros(3)
        for idx in np.array_split(mine, n_batches):
            totals += self.framework.evaluate(data.x_val[idx], data.y_val[idx])
        loss_sum, correct, count = self.backend.all_reduce(totals)
        if count == 0:
            return math.nan, None
        accuracy = None if data.info.task == "regression" else correct / count
        return loss_sum / count, accuracy

    def _save(self, result: TrainResult) -> None:
        state = self.framework.export_state()  # collective on sharded backends: every rank calls it
        digests = self.backend.all_gather_object(state_digest(state))
        if self.world.rank != 0:
            return
        import polytrain

        manifest = {
            "polytrain": polytrain.__version__, "spec": self.spec.to_dict(), "spec_digest": self.spec.digest(),
            "framework": self.spec.framework, "backend": self.backend.name, "world_size": self.world.size,
            "global_step": result.global_step, "epochs": result.epochs_done, "val_accuracy": result.val_accuracy,
            "val_loss": result.val_loss, "rank_state_digests": digests,
        }
        write_model(Path(self.spec.output), state, manifest)
        if result.val_accuracy is not None:
            self.progress.line(f"validation accuracy: {result.val_accuracy:.4f}")
        else:
            self.progress.line(f"validation loss: {result.val_loss:.6f}")
        self.progress.line(f"model saved to {Path(self.spec.output) / 'model.safetensors'}")

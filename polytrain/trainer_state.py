"""A training run's checkpoints: writing them, finding and restoring the one to resume from, and
the final model. Part of `polytrain.trainer.Trainer` (a base class of it), kept apart for length."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain import checkpoint as ckpt
from polytrain import objectives
from polytrain.callbacks import (
    BestCheckpoints,
    CallbackList,
    EarlyStopping,
    RunInfo,
    check_callback,
    check_monitor,
    load_callbacks,
)
from polytrain.data import Data
from polytrain.environments import restart_count
from polytrain.errors import SpecError, TrainingFailure
from polytrain.failures import library_versions, settled
from polytrain.schedule import lr_at
from polytrain.version import __version__


@dataclass
class TrainResult:
    global_step: int = 0
    epochs_done: int = 0
    train_loss: float = math.nan
    val_loss: float = math.nan
    val_accuracy: float | None = None
    #: the last evaluation's metrics by name (``accuracy``, ``mae``, a user function's name, ...)
    val_metrics: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False
    samples_per_s: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Position:
    """Where training stands: the next step to run, its epoch and index within the epoch."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


class TrainerCheckpoints:
    """The checkpoint half of the Trainer; it reads the run's state from the Trainer's attributes."""

    def _set_up_callbacks(self, data: Data) -> None:
        """The spec's and the caller's callbacks, early stopping and the best checkpoints; monitored names
        are checked against what this run logs (one-line errors before anything is built)."""
        spec, world = self.spec, self.world
        run = RunInfo(world.rank, world.size, world.local_rank, spec)
        for i, obj in enumerate(self.extra_callbacks):
            check_callback(obj, f"callbacks[{i}]")
        self.callbacks = CallbackList([*load_callbacks(spec.callbacks or ()), *self.extra_callbacks], run)
        metrics = objectives.metric_names(spec.metrics, data.info.task)
        validated = {"val_loss", *(f"val_{objectives.metric_key(m)}" for m in metrics)}
        logged = {"train_loss", *(validated if len(data.val) else ())}
        stopping, ck = spec.loop.early_stopping, spec.checkpoint
        self.early_stopping, self.best, self.stopped_early = None, None, False
        for field_name, monitor in (("loop.early_stopping.monitor", stopping.monitor), ("checkpoint.monitor", ck.monitor)):
            if monitor in validated and not len(data.val):
                raise SpecError(f"{field_name}: {monitor!r} needs validation data and this run has none "
                                f"(data.val_fraction is 0 and no validation set was given); monitor train_loss, or "
                                f"set data.val_fraction above 0")
        if stopping.monitor is not None:
            check_monitor("loop.early_stopping.monitor", stopping.monitor, logged)
            self.early_stopping = EarlyStopping(stopping.monitor, stopping.mode, stopping.patience, stopping.min_delta)
        if ck.monitor is not None:
            check_monitor("checkpoint.monitor", ck.monitor, logged)
            self.best = BestCheckpoints(spec.checkpoint_dir / "best", ck.monitor, ck.mode, ck.save_top_k)

    @property
    def checkpointing(self) -> bool:
        """Whether this run writes resumable checkpoints (and so leaves its final state resumable)."""
        ck = self.spec.checkpoint
        return bool(ck.every_n_steps or ck.every_n_epochs or ck.save_last)

    def _save_best(self, pos: Position, record: dict[str, Any]) -> None:
        """After a validation: a checkpoint under ``best/`` when the monitored value is among the top k."""
        if self.best is None:
            return
        value = float(record[self.best.monitor])
        if not self.backend.broadcast_object(self.best.wants(value) if self.world.rank == 0 else None):
            return
        path = self._save_checkpoint(pos, self.best.root)
        if self.world.rank == 0:
            self.best.keep(path, pos.step, record["epoch"], value)
            self.log.write("best_checkpoint", step=pos.step, monitor=self.best.monitor, value=value, path=str(path))

    def _save_checkpoint(self, pos: Position, root: Path | None = None) -> Path:
        with self.timeline.span("checkpoint", "checkpoint", step=pos.step):
            path = self._write_checkpoint(pos, root)
        self.callbacks.call("on_checkpoint", pos.step, path)
        return path

    def _write_checkpoint(self, pos: Position, best_root: Path | None = None) -> Path:
        """Every rank takes part (state gathering is collective); rank 0 writes. Returns the directory
        (the same path on every rank)."""
        self._activity.set(f"the checkpoint at step {pos.step}")
        model = self.framework.export_state()
        optimizer = self.framework.export_optimizer_state()
        rng = self.backend.all_gather_object(self.framework.rng_state())
        root = best_root or self.spec.checkpoint_dir
        if best_root is None:
            self._last_saved = pos.step
        # rank 0 writes; every rank learns at once whether it could (a full disk is not a timeout elsewhere)
        settled(self.backend, self.world.size,
                lambda: self._write_files(pos, root, best_root, model, optimizer, rng) if self.world.rank == 0
                else None)
        return root / ckpt.step_dir_name(pos.step)

    def _write_files(self, pos: Position, root: Path, best_root: Path | None, model: dict[str, Any],
                     optimizer: dict[str, Any], rng: list[Any]) -> Path:
        manifest = {
            **self._describe(), "epoch": pos.epoch, "step_in_epoch": pos.step_in_epoch,
            "samples_in_epoch": min(pos.step_in_epoch * self.global_batch, self.per_epoch * self.global_batch),
            "global_batch": self.global_batch, "rng_states": rng,
            # the learning rate is a function of the step (polytrain.schedule); recorded for readers
            "lr": lr_at(max(pos.step - 1, 0), optimizer=self.spec.optimizer, schedule=self.spec.schedule,
                        world_size=self.shard.count, steps_per_epoch=self.per_epoch,
                        total_steps=self._horizon()),
            "loss_scaler": self.framework.loss_scaler_state(),
            "early_stopping": {**self.early_stopping.state(), "stopped": self.stopped_early}
            if self.early_stopping is not None else None,
        }
        try:
            path = ckpt.save_checkpoint(root, pos.step, {"model": model, "optimizer": optimizer}, manifest,
                                        keep_last=None if best_root else self.spec.checkpoint.keep_last)
        except OSError as exc:  # disk full, file too large, read-only or missing directory
            kept = ckpt.complete_checkpoints(root)
            previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
            raise TrainingFailure(
                f"checkpoint.dir: cannot write the checkpoint of step {pos.step} under {root} "
                f"({exc.strerror or exc}); {previous}; free space or choose another checkpoint.dir, then "
                "resume with --resume auto") from exc
        self.log.write("checkpoint", step=pos.step, path=str(path))
        return path

    def _resume_target(self) -> str | None:
        """``--resume``, or ``auto`` when an elastic launcher restarted this worker and checkpoints are on."""
        if self.resume:
            return self.resume
        return "auto" if restart_count() > 0 and self.checkpointing else None

    def _restore(self) -> Position:
        """Load the checkpoint named by --resume into the model and optimizer; return where to go on."""
        target, size = self._resume_target(), self.world.size
        # rank 0 chooses, every rank reads: a failure on any rank (say, a path the others cannot see on a
        # filesystem that is not shared) ends every rank at once with the same line
        found = settled(self.backend, size, lambda: ckpt.resolve(target, self.spec.checkpoint_dir)
                        if self.world.rank == 0 else None)
        path = self.backend.broadcast_object(str(found) if found else None)
        if path is None:
            self.progress.line(f"no checkpoint in {self.spec.checkpoint_dir}: starting from scratch")
            return Position()
        manifest, tensors = settled(self.backend, size, lambda: ckpt.load_checkpoint(Path(path)))
        if manifest.get("model_digest") != self.spec.model_digest():
            raise ckpt.CheckpointError(
                f"--resume: {path} was written by a different model/data/seed (model digest "
                f"{manifest.get('model_digest')} vs this spec's {self.spec.model_digest()}); resume it with the "
                f"spec that wrote it (saved in its manifest.json), or start without --resume")
        if manifest.get("global_batch", self.global_batch) != self.global_batch and manifest.get("step_in_epoch"):
            raise ckpt.CheckpointError(
                f"--resume: {path} stopped mid-epoch with a global batch of {manifest['global_batch']}, "
                f"this run's is {self.global_batch}; set data.global_batch_size={manifest['global_batch']}")
        self.framework.load_state(tensors["model"])
        self.framework.load_optimizer_state(tensors.get("optimizer", {}))
        same_rng = manifest.get("framework") == self.spec.framework and manifest["world_size"] == self.world.size
        if manifest.get("loss_scaler"):
            self.framework.load_loss_scaler_state(manifest["loss_scaler"])
        if self.early_stopping is not None and manifest.get("early_stopping"):
            self.early_stopping.load(manifest["early_stopping"])
            self.stopped_early = bool(manifest["early_stopping"].get("stopped"))
        if same_rng and len(manifest.get("rng_states", [])) == self.world.size:  # another framework's RNG: skip
            self.framework.set_rng_state(manifest["rng_states"][self.world.rank])
        pos = Position(manifest["global_step"], manifest["epoch"], manifest["step_in_epoch"])
        self.progress.line(f"resumed from {path} at step {pos.step} (epoch {pos.epoch + 1}, "
                           f"step {pos.step_in_epoch} of the epoch)")
        self.log.write("resume", step=pos.step, path=str(path))
        return pos

    def _describe(self) -> dict[str, Any]:
        return {
            "polytrain": __version__, "spec": self.spec.to_dict(), "spec_digest": self.spec.digest(),
            "model_digest": self.spec.model_digest(), "framework": self.spec.framework,
            "backend": self.backend.name, "world_size": self.world.size, "versions": library_versions(),
        }

    def _save_model(self, result: TrainResult) -> None:
        state = self.framework.export_state()  # collective on sharded backends: every rank calls it
        digests = self.backend.all_gather_object(ckpt.state_digest(state))
        settled(self.backend, self.world.size, lambda: self._write_model(result, state, digests)
                if self.world.rank == 0 else None)

    def _write_model(self, result: TrainResult, state: dict[str, Any], digests: list[str]) -> None:
        manifest = {**self._describe(), "global_step": result.global_step, "epochs": result.epochs_done,
                    "val_accuracy": result.val_accuracy,
                    "val_loss": None if math.isnan(result.val_loss) else result.val_loss, "rank_state_digests": digests}
        try:
            ckpt.write_model(Path(self.spec.output), state, manifest)
        except OSError as exc:
            raise TrainingFailure(f"output: cannot write the trained model to {self.spec.output} "
                                  f"({exc.strerror or exc}); free space or choose another output directory") from exc
        if result.val_accuracy is not None:
            self.progress.line(f"validation accuracy: {result.val_accuracy:.4f}")
        elif not math.isnan(result.val_loss):
            self.progress.line(f"validation loss: {result.val_loss:.6f}")
        self.progress.line(f"model saved to {Path(self.spec.output) / 'model.safetensors'}")

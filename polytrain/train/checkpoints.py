"""A training run's checkpoints: where the run begins (a fresh start, or the checkpoint it resumes from, its data
checked against this run's), the checkpoints it writes, its best ones, and the final model.

`RunCheckpoints` is built by the Trainer from what it needs and nothing else: the spec, the World, the two
adapters, the run's callbacks (`polytrain.train.callbacks.RunHooks`), how its epochs cut into steps
(`polytrain.train.state.Steps`) and what its data is (`polytrain.checkpoint.fingerprint`). `begin` decides where
the run starts and which run it is (a resumed run goes on with its checkpoint's run id), and returns that; the
saves record it, in manifests built by the one builder the own loops use too (`polytrain.checkpoint.record`). Every method is called on every rank: rank 0 writes, and the others learn at once whether it
could (`polytrain.comm.settle.settled`).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polytrain.checkpoint import record
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint.fingerprint import changes
from polytrain.checkpoint.manifest import restore_rng
from polytrain.checkpoint.writer import BackgroundWrite
from polytrain.comm.settle import settled
from polytrain.environments import restart_count
from polytrain.errors import TrainingFailure
from polytrain.observe.metrics import MetricsLog, Progress
from polytrain.observe.timeline import Timeline
from polytrain.observe.trackers import Trackers
from polytrain.observe.watchdog import Activity
from polytrain.protocols import Backend, Framework
from polytrain.spec.tables import TrainSpec
from polytrain.train.callbacks import RunHooks
from polytrain.train.claim import claim, earlier_outputs_aside
from polytrain.train.state import Position, Steps, TrainResult
from polytrain.world import World


@dataclass(frozen=True)
class Start:
    """Where a run begins (`RunCheckpoints.begin`): its first position, and its steps with the offset a resume
    onto another number of steps per epoch brings (`Steps.offset`). ``complete``: why there is nothing to train
    (the resumed checkpoint is at or past the run's last step, or its run stopped early), else None."""

    position: Position
    steps: Steps
    complete: str | None = None


@dataclass(frozen=True)
class Restored:
    """The checkpoint a resume loaded (`RunCheckpoints._restore`): where it stands and what changed since."""

    path: str
    position: Position
    #: what changed in the data since the checkpoint (--accept-changed-data), or None
    changed: str | None


class RunCheckpoints:
    """One run's checkpoints under ``checkpoint.dir`` (and ``best/``), and its final model under ``output``."""

    def __init__(self, spec: TrainSpec, world: World, backend: Backend, framework: Framework, hooks: RunHooks,
                 steps: Steps, dataset: dict[str, Any] | None, *, log: MetricsLog, progress: Progress,
                 timeline: Timeline, activity: Activity) -> None:
        """``dataset``: rank 0's fingerprint of the run's data (None on the other ranks), recorded in every
        checkpoint and compared with a resumed checkpoint's."""
        self.spec, self.world, self.backend, self.framework, self.hooks = spec, world, backend, framework, hooks
        self.steps, self.dataset = steps, dataset
        self.log, self.progress, self.timeline, self.activity = log, progress, timeline, activity
        #: the run this one is: whose checkpoints it may touch (a fresh run's; `begin` takes a resumed one's)
        self.owner = ckpt.Owner(ckpt.new_run_id())
        #: the step of the last resumable checkpoint written (not counting best/)
        self.last_saved: int | None = None
        #: rank 0's tracker runs by tracker name, kept in every checkpoint; those a resumed checkpoint kept
        self.trackers = Trackers()
        self.resumed_trackers: dict[str, str] = {}
        #: ``checkpoint.async_save``: the save still being written (its step; rank 0 holds the write itself)
        self._pending: tuple[int, Path, BackgroundWrite | None] | None = None
        #: the arrays of the last background write, once written: the next save copies into them
        self._spare: tuple[dict[str, Any], dict[str, Any]] = ({}, {})

    @property
    def enabled(self) -> bool:
        """Whether this run writes resumable checkpoints (and so leaves its final state resumable): a run with a
        ``preemption`` table does, at the step it stops at if at no other."""
        ck = self.spec.checkpoint
        return bool(ck.every_n_steps or ck.every_n_epochs or ck.save_last or self.spec.preemption is not None)

    # ------------------------------------------------------------------ the start
    def begin(self, resume: str | None, *, accept_changed_data: bool = False, overwrite: bool = False) -> Start:
        """Where this run begins: the start, or the checkpoint ``resume`` (--resume) names, its data checked
        against this run's (``accept_changed_data``: a change starts the checkpoint's epoch over). Then, when the
        run writes checkpoints, checkpoint.dir is probed and claimed for it (``overwrite``: another run's
        checkpoints there move aside, else the run is refused).

        A resumed run is complete when its checkpoint's global step is at or past this run's last step
        (``Steps.total``: the end of ``loop.epochs``, or ``loop.max_steps``) or its run stopped early: then nothing
        is written (no record, no checkpoint, no claim) and `Start.complete` says why. Raising ``loop.epochs`` or
        ``loop.max_steps`` moves the last step, and the resumed run trains the steps added. A resumed run that goes
        on sets aside the best checkpoints of later steps than its checkpoint's (`polytrain.train.claim`)."""
        target = self._resume_target(resume)
        restored = self._restore(target, accept_changed_data) if target else None
        if restored is None:
            pos = Position()
        else:
            pos = restored.position
            complete = self._complete(restored)
            if complete is not None:
                self.progress.line(complete)
                return Start(pos, self.steps, complete)
            self._announce(restored)
        if self.enabled or self.hooks.best is not None:  # probed, and claimed for this run (polytrain.train.claim)
            resumed_at = None if restored is None else pos.step
            settled(self.backend, self.world.size, lambda: claim(
                self.spec, self.owner, self.hooks.best, overwrite=overwrite, resumed_at=resumed_at, log=self.log,
                progress=self.progress) if self.world.rank == 0 else None)
        elif restored is None:  # no checkpoints to claim: a fresh run still starts its own log
            settled(self.backend, self.world.size, lambda: earlier_outputs_aside(
                self.spec, self.log, self.progress) if self.world.rank == 0 else None)
        return Start(pos, self.steps)

    def _complete(self, restored: Restored) -> str | None:
        """Why the run of ``restored`` has nothing left to train, or None."""
        step, loop = restored.position.step, self.spec.loop
        if self.hooks.stopped_early:
            return (f"the run is complete: it stopped early (loop.early_stopping) before {restored.path} at step "
                    f"{step}; nothing to train (start without --resume to train afresh)")
        if step < self.steps.total:
            return None
        limits = f"loop.epochs: {loop.epochs}" + (f", loop.max_steps: {loop.max_steps}" if loop.max_steps else "")
        return (f"the run is complete: {restored.path} is at step {step}, and this run ends at step "
                f"{self.steps.total} ({limits}); nothing to train (raise loop.epochs or loop.max_steps to train on)")

    def _announce(self, restored: Restored) -> None:
        """The lines and records of a resume that goes on training."""
        pos = restored.position
        self.progress.line(f"resumed from {restored.path} at step {pos.step} (epoch {pos.epoch + 1}, "
                           f"step {pos.step_in_epoch} of the epoch)")
        if restored.changed is not None:
            self.progress.line(f"the data changed since that checkpoint ({restored.changed}); --accept-changed-data: "
                               f"epoch {pos.epoch + 1} starts over on this data")
            self.log.write("data_changed", step=pos.step, epoch=pos.epoch, changes=restored.changed)
        self.log.write("resume", step=pos.step, path=restored.path)

    def _resume_target(self, resume: str | None) -> str | None:
        """``--resume``, or ``auto`` when an elastic launcher restarted this worker and checkpoints are on."""
        if resume:
            return resume
        return "auto" if restart_count() > 0 and self.enabled else None

    def _restore(self, resume: str, accept_changed_data: bool) -> Restored | None:
        """Load the checkpoint named by ``resume`` into the model and optimizer; return it and where to go on
        (None: there is no checkpoint to resume, the run starts from scratch)."""
        size, global_batch = self.world.size, self.steps.global_batch
        # rank 0 chooses, every rank reads: a failure on any rank (say, a path the others cannot see on a
        # filesystem that is not shared) ends every rank at once with the same line
        found = settled(self.backend, size, lambda: ckpt.resolve(resume, self.spec.checkpoint_dir)
                        if self.world.rank == 0 else None)
        path = self.backend.broadcast_object(str(found) if found else None)
        if path is None:
            self.progress.line(f"no checkpoint in {self.spec.checkpoint_dir}: starting from scratch")
            return None
        manifest, tensors = settled(self.backend, size, lambda: ckpt.load_checkpoint(Path(path)))
        if manifest.get("origin") == record.ORIGIN:  # a hand-written loop's: it knows no spec
            record.check_names(Path(path), tensors["model"], self.framework.parameter_shapes(), "spec's model",
                               exact=False)
        elif manifest.get("model_digest") != self.spec.model_digest():
            raise ckpt.CheckpointError(
                f"--resume: {path} was written by a different model/data/seed (model digest "
                f"{manifest.get('model_digest')} vs this spec's {self.spec.model_digest()}); resume it with the "
                f"spec that wrote it (saved in its manifest.json), or start without --resume")
        self.resumed_trackers = dict(manifest.get("trackers") or {})
        run_id = manifest.get(ckpt.RUN_KEY)  # the same run goes on; before run ids: its checkpoints of this model
        self.owner = ckpt.Owner(run_id) if run_id else ckpt.Owner(self.owner.run_id, self.spec.model_digest())
        # rank 0's verdict (its files are the ones it recorded), the same on every rank
        changed = self.backend.broadcast_object(settled(self.backend, size, lambda: self._data_changes(
            path, manifest, accept_changed_data) if self.world.rank == 0 else None))
        if manifest.get("global_batch", global_batch) != global_batch and manifest.get("step_in_epoch") \
                and changed is None:  # a changed dataset's epoch starts over: no position inside it to keep
            raise ckpt.CheckpointError(
                f"--resume: {path} stopped mid-epoch with a global batch of {manifest['global_batch']}, "
                f"this run's is {global_batch}; set data.global_batch_size={manifest['global_batch']}")
        self.framework.load_state(tensors["model"])
        self.framework.load_optimizer_state(tensors.get("optimizer", {}))
        same_rng = manifest.get("framework") == self.spec.framework  # another framework's RNG: skip
        if manifest.get("loss_scaler"):
            self.framework.load_loss_scaler_state(manifest["loss_scaler"])
        if self.hooks.early_stopping is not None:
            self.hooks.early_stopping.load(manifest.get("early_stopping"))
        if same_rng:  # at the same world size; a state the framework refuses is one line
            restore_rng(self.framework.set_rng_state, manifest, Path(path), self.world)
        pos = Position(manifest["global_step"], manifest["epoch"], 0 if changed else manifest["step_in_epoch"])
        self.steps = replace(self.steps, offset=pos.step - pos.epoch * self.steps.per_epoch - pos.step_in_epoch)
        return Restored(str(path), pos, changed)

    def _data_changes(self, path: str, manifest: dict[str, Any], accept_changed_data: bool) -> str | None:
        """Rank 0: None when the checkpoint's data is this run's (or it recorded none: older polytrain); what
        changed when --accept-changed-data allows it; else a one-line refusal."""
        recorded = manifest.get("dataset")
        if not isinstance(recorded, dict) or self.dataset is None:
            return None
        what = changes(recorded, self.dataset)
        if what is None or accept_changed_data:
            return what
        epoch = int(manifest.get("epoch", 0)) + 1
        raise ckpt.CheckpointError(
            f"--resume: the data changed since {path} was written ({what}); its position would repeat or skip "
            f"samples: resume with the data it was trained on, or pass --accept-changed-data to start epoch "
            f"{epoch} over on this data")

    # ------------------------------------------------------------------ saves
    def save(self, pos: Position, root: Path | None = None) -> Path:
        """A resumable checkpoint of ``pos`` under checkpoint.dir (or ``root``, the best checkpoints'); every rank
        takes part, the callbacks hear of it once it is written. Returns the directory (the same path on every
        rank). With ``checkpoint.async_save`` a regular save is written in the background (see `settle`); the
        best checkpoints, whose index names them at once, are written before this returns."""
        background = self.spec.checkpoint.async_save and root is None
        with self.timeline.span("checkpoint", "checkpoint", step=pos.step):
            self.settle()  # one write at a time, and a failed one is known everywhere before the next
            path = self._write(pos, root, background)
        if not background:
            self._written(pos.step, path)
        return path

    def settle(self) -> None:
        """Wait for the save being written in the background, if any: every rank learns whether it failed (raised
        as its one-line failure on every rank), then it is logged and the callbacks hear of it. Every rank calls
        this at the same points: before each save and at the end of the run."""
        if self._pending is None:
            return
        (step, path, write), self._pending = self._pending, None
        self.activity.set(f"the background write of the checkpoint at step {step}")  # what the others wait for
        settled(self.backend, self.world.size, lambda: write.result() if write is not None else None)
        self._spare = write.state if write is not None else ({}, {})
        self._written(step, path)

    def abandon(self) -> None:
        """A failing run: let a write in progress end (or fail) on its own, without telling the other ranks."""
        if self._pending is not None and self._pending[2] is not None:
            self._pending[2].wait_quietly()
        self._pending = None

    def _written(self, step: int, path: Path) -> None:
        if self.world.rank == 0:
            self.log.write("checkpoint", step=step, path=str(path))
        self.hooks.callbacks.call("on_checkpoint", step, path)

    def save_best(self, pos: Position, record: dict[str, Any]) -> None:
        """After a validation: a checkpoint under ``best/`` when the monitored value is among the top k."""
        best = self.hooks.best
        if best is None:
            return
        value = float(record[best.monitor])
        if not self.backend.broadcast_object(best.wants(value) if self.world.rank == 0 else None):
            return
        path = self.save(pos, best.root)
        # rank 0 ranks it; every rank learns at once whether it could (a full disk, something in the way)
        settled(self.backend, self.world.size, lambda: self._rank_best(path, pos.step, record["epoch"], value)
                if self.world.rank == 0 else None)

    def _rank_best(self, path: Path, step: int, epoch: int, value: float) -> None:
        best = self.hooks.best
        best.keep(path, step, epoch, value)
        self.log.write("best_checkpoint", step=step, monitor=best.monitor, value=value, path=str(path))

    def _write(self, pos: Position, best_root: Path | None = None, background: bool = False) -> Path:
        """Every rank takes part (state gathering is collective); rank 0 writes, now or on a thread of its own."""
        self.activity.set(f"the checkpoint at step {pos.step}")
        spare, self._spare = self._spare, ({}, {})
        model = self.framework.export_state(spare[0])  # copies: the loop may train on while they are written
        optimizer = self.framework.export_optimizer_state(spare[1])
        rng = self.backend.all_gather_object(self.framework.rng_state())
        root = best_root or self.spec.checkpoint_dir
        path = root / ckpt.step_dir_name(pos.step)
        if best_root is None:
            self.last_saved = pos.step
        if background:
            manifest = self._manifest(pos, rng) if self.world.rank == 0 else {}  # taken now, not as it later is
            write = BackgroundWrite(lambda: self._commit(pos, root, best_root, model, optimizer, manifest),
                                    pos.step, (model, optimizer)) if self.world.rank == 0 else None
            self._pending = (pos.step, path, write)
            return path
        # rank 0 writes; every rank learns at once whether it could (a full disk is not a timeout elsewhere)
        settled(self.backend, self.world.size,
                lambda: self._commit(pos, root, best_root, model, optimizer, self._manifest(pos, rng))
                if self.world.rank == 0 else None)
        return path

    def _manifest(self, pos: Position, rng: list[Any]) -> dict[str, Any]:
        steps = self.steps
        return record.manifest(
            self._writer(), epoch=pos.epoch, step_in_epoch=pos.step_in_epoch,
            samples_in_epoch=min(pos.step_in_epoch * steps.global_batch, steps.per_epoch * steps.global_batch),
            rng_states=rng, loss_scaler=self.framework.loss_scaler_state(), global_batch=steps.global_batch,
            # the learning rate is a function of the step (polytrain.train.schedule); recorded for readers
            lr=steps.lr(max(pos.step - 1, 0), self.spec),
            early_stopping=self.hooks.early_stopping.state() if self.hooks.early_stopping is not None else None,
            dataset=self.dataset)

    def _commit(self, pos: Position, root: Path, best_root: Path | None, model: dict[str, Any],
                optimizer: dict[str, Any], manifest: dict[str, Any]) -> Path:
        try:
            path = ckpt.save_checkpoint(root, pos.step, {"model": model, "optimizer": optimizer}, manifest,
                                        keep_last=None if best_root else self.spec.checkpoint.keep_last,
                                        owner=self.owner)
        except OSError as exc:  # disk full, file too large, read-only or missing directory
            kept = ckpt.complete_checkpoints(root)
            previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
            raise TrainingFailure(
                f"checkpoint.dir: cannot write the checkpoint of step {pos.step} under {root} "
                f"({exc.strerror or exc}); {previous}; free space or choose another checkpoint.dir, then "
                "resume with --resume auto") from exc
        return path

    def _writer(self) -> record.Writer:
        return record.Writer(self.spec.framework, self.backend.name, self.world.size, self.owner.run_id,
                             self.trackers.ids(), self.spec)

    # ------------------------------------------------------------------ the final model
    def model_written(self, step: int) -> bool:
        """Whether ``output`` holds this run's final model of ``step`` (rank 0 reads its model.json; every rank
        gets rank 0's answer)."""
        def written() -> bool:
            try:
                manifest = json.loads((Path(self.spec.output) / "model.json").read_text())
            except (OSError, ValueError):
                return False
            return isinstance(manifest, dict) and manifest.get("global_step") == step and \
                manifest.get(ckpt.RUN_KEY) in (self.owner.run_id, None)

        return bool(self.backend.broadcast_object(settled(self.backend, self.world.size, lambda: written()
                                                          if self.world.rank == 0 else None)))

    def save_model(self, result: TrainResult) -> dict[str, Any]:
        """Write the final model (rank 0); returns its full state, which every rank has."""
        self.activity.set("the final model")
        state = self.framework.export_state()  # collective on sharded backends: every rank calls it
        ranks = self.backend.all_gather_object((ckpt.state_digest(state), peak_memory()))
        settled(self.backend, self.world.size, lambda: self._write_model(result, state, ranks)
                if self.world.rank == 0 else None)
        return state

    def _write_model(self, result: TrainResult, state: dict[str, Any], ranks: list[tuple[str, dict]]) -> None:
        manifest = {**record.identity(self._writer()), "global_step": result.global_step, "epochs": result.epochs_done,
                    "val_accuracy": result.val_accuracy,
                    "val_loss": None if math.isnan(result.val_loss) else result.val_loss,
                    "rank_state_digests": [digest for digest, _ in ranks],
                    "rank_peak_memory": [peak for _, peak in ranks]}
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


def peak_memory() -> dict[str, int | None]:
    """This process's peak memory so far, in bytes: its resident set (``host``), and what PyTorch allocated on its
    accelerator (``device``; None without one). The final model.json records it per rank, so that a layout's memory
    is there to compare from run to run."""
    import resource

    device = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = int(torch.cuda.max_memory_allocated())
    return {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "device": device}

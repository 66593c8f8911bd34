"""Training that goes on in place when a rank is lost (issue 51): commits in host memory, and the recovery.

Under polytrain's elastic driver (`polytrain.launchers.elastic`) the torch backend forms its group on the
driver's store (`polytrain.adapters.torch.elastic_group`), and the Trainer runs its loop through `ElasticRun`:

* **Commits.** Every ``elastic.commit_every_n_steps`` optimizer steps (and at the start) each rank copies into
  host memory what a checkpoint holds — the model, the optimizer, the loss scaler, its RNG state, the position in
  the data, early stopping's state and the state of every callback that has ``state_dict``/``load_state_dict``
  — the portable state the checkpoint code exports, with no file written. A commit is built whole, then it
  replaces the last one: a failure while committing leaves the previous commit as it was.
* **Recovery.** When a collective fails because a peer is gone (`reform.is_peer_loss`), the survivors drop the
  wrapper over the old group, release it, tell the driver and wait for its next membership version, form that
  group in the same process, wrap the same module and optimizer again (fsdp: a fresh one), load the commit, and
  go on from the committed position at the new world size. The global batch stays what it was
  (``Steps.global_batch``), so each rank's share grows and the data plan (`polytrain.data.epoch_plan`) uses
  every remaining sample of the epoch exactly once at the new size.
* **Too few ranks.** When the driver cannot find ``--min-np`` slots within ``--elastic-timeout`` it forms a
  final round of the survivors (`polytrain.comm.membership.Assignment.final`): they load the commit, write it as a
  normal checkpoint (the run's ``checkpoint.dir``) and end with one line naming it and the driver's reason.

Every rank's commit is the whole state: on ddp and horovod (polytrain's implementation) each rank holds it; on fsdp
the commit gathers it (a collective), and a re-form wraps a fresh module the commit is sharded into
(`elastic_group.regroup`). Other backends say why not through the torch contract (`in_place_refusal`), in one
line; TensorFlow is refused by the spec (docs/DESIGN.md, "Elastic training in place", says what is left).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from polytrain.errors import SpecError, TrainingFailure
from polytrain.train.state import Position, TrainResult


@dataclasses.dataclass
class Commit:
    """One rank's copy of the training state at ``position`` (what a checkpoint of that step would hold)."""

    position: Position
    model: dict[str, Any]
    optimizer: dict[str, Any]
    loss_scaler: dict[str, float] | None
    rng: Any
    early_stopping: dict[str, Any] | None
    callbacks: dict[int, Any]


class ElasticRun:
    """The Trainer's loop under the elastic driver: `run` commits and recovers; `after_step` commits when due."""

    def __init__(self, trainer: Any, every: int) -> None:
        self.trainer, self.every = trainer, every
        self.commit: Commit | None = None
        self.spare: Commit | None = None  # the commit before the last: the next one is copied into its arrays
        self.recoveries = 0

    @classmethod
    def of(cls, trainer: Any) -> ElasticRun | None:
        """The elastic run of ``trainer``: None when its backend formed no group on an elastic driver's store. A
        spec's ``elastic`` table in a distributed job another launcher started, or a backend that cannot recover
        in place, is one line."""
        spec, backend = trainer.spec, trainer.backend
        if getattr(backend, "membership", None) is None:
            if spec.elastic is not None and trainer.world.size > 1:
                raise SpecError(f"elastic: this job was started by {trainer.world.launcher}, not polytrain's elastic "
                                "driver; start it with polytrain launch --launcher local (or horovodrun) --elastic")
            return None
        if backend.in_place_refusal:  # sharded state, real Horovod (the torch backend contract says)
            raise SpecError(backend.in_place_refusal)
        return cls(trainer, spec.elastic.commit_every_n_steps if spec.elastic is not None else 1)

    # ------------------------------------------------------------------ commits
    def after_step(self, here: Position) -> None:
        """Commit at ``here`` when it is a multiple of ``commit_every_n_steps``."""
        if here.step % self.every == 0:
            self.take(here)

    def take(self, here: Position) -> None:
        """Copy the state at ``here`` into host memory; it replaces the last commit only once it is whole. The
        arrays of the commit before the last are filled again (no new memory per commit), and the RNG state is
        the new lists ``rng_state`` makes (a deep copy of the CPU generator's 5056 numbers cost ~1.3 ms)."""
        t = self.trainer
        fw, hooks = t.framework, t.hooks
        callbacks = {i: copy.deepcopy(cb.state_dict()) for i, cb in enumerate(hooks.callbacks.callbacks)
                     if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None))}
        spare = self.spare
        commit = Commit(
            position=dataclasses.replace(here), model=fw.export_state(spare.model if spare else None),
            optimizer=fw.export_optimizer_state(spare.optimizer if spare else None),
            loss_scaler=fw.loss_scaler_state(), rng=fw.rng_state(),
            early_stopping=hooks.early_stopping.state() if hooks.early_stopping is not None else None,
            callbacks=callbacks)
        self.spare, self.commit = self.commit, commit

    # ------------------------------------------------------------------ the loop and the recovery
    def run(self, loop: Callable[[Position], TrainResult], start: Position) -> TrainResult:
        """``loop`` from ``start``; after a lost peer, from the last commit on the re-formed group, until it ends."""
        self.take(start)
        while True:
            try:
                return loop(dataclasses.replace(self.commit.position))
            except Exception as exc:
                from polytrain.adapters.torch import reform

                if not reform.is_peer_loss(exc):
                    raise
                cause = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            # the exception, its traceback and the frames they hold (loss, Work handles, the data reader) are gone
            self.recover(cause)

    def recover(self, cause: str) -> None:
        """Re-form the group at the driver's next membership version and load the last commit."""
        from polytrain.adapters.torch import elastic_group

        t = self.trainer
        before = t.world.size
        t.activity.set("re-forming the group after a lost peer")
        assignment = elastic_group.regroup(t.framework, t.backend, final=True)
        world = t.world = t.checkpoints.world = t.backend.world
        t.steps = t.checkpoints.steps = dataclasses.replace(t.steps, shard=t.backend.data_shard)
        t.hooks.callbacks.run = dataclasses.replace(t.hooks.callbacks.run, rank=world.rank, world_size=world.size,
                                                    local_rank=world.local_rank)
        self.load(self.commit)
        self.recoveries += 1
        pos = self.commit.position
        if assignment.final:  # too few ranks to go on: the commit becomes a checkpoint, so a restart loses nothing
            t.activity.set(f"writing the last commit (step {pos.step}) as a checkpoint")
            path = t.checkpoints.save(dataclasses.replace(pos))
            t.checkpoints.settle()
            raise TrainingFailure(f"elastic: {assignment.final}; the last commit (step {pos.step}) is saved as "
                                  f"{path}: resume from it with --resume auto")
        t.progress.line(f"elastic: a peer was lost ({cause}); re-formed from {before} to {world.size} ranks "
                        f"(membership version {assignment.version}), going on from the commit at step {pos.step}")
        t.log.write("elastic_recovery", step=pos.step, epoch=pos.epoch, world_size=world.size,
                    version=assignment.version, cause=cause)

    def load(self, commit: Commit) -> None:
        """Put ``commit`` back into the model, optimizer, loss scaler, RNG, early stopping and callbacks."""
        t = self.trainer
        fw, hooks = t.framework, t.hooks
        fw.load_state(commit.model)
        fw.load_optimizer_state(commit.optimizer)
        if commit.loss_scaler:
            fw.load_loss_scaler_state(commit.loss_scaler)
        fw.set_rng_state(copy.deepcopy(commit.rng))
        fw.discard_gradients()
        if hooks.early_stopping is not None:
            hooks.early_stopping.load(commit.early_stopping)
        for i, state in commit.callbacks.items():
            hooks.callbacks.callbacks[i].load_state_dict(copy.deepcopy(state))

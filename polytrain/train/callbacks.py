"""Hooks into a training run: the user's callbacks, early stopping and the best checkpoints.

A callback is any object with some of these methods (a `Callback` subclass has them all, doing
nothing); the Trainer calls them on every rank, with a `RunInfo` that says which rank this is:

- ``on_train_start(run)`` — the model is built (and restored, on a resume); before the first step
- ``on_step_end(run, step, logs)`` — after each optimizer step; ``logs`` has ``epoch``, ``lr`` and,
  when a logging window closes, the window's ``loss`` (the same on every rank)
- ``on_validation_end(run, epoch, logs)`` — after each evaluation: the epoch record (``train_loss``,
  ``val_loss``, ``val_<metric>``), reduced across ranks
- ``on_checkpoint(run, step, path)`` — after a checkpoint was written (``path`` on every rank)
- ``on_train_end(run, result)`` — after the final model was saved

Early stopping and the choice of the best checkpoints follow Lightning's ``EarlyStopping`` and
``ModelCheckpoint`` (monitor, mode, patience/min_delta, save_top_k); both are decided from the
reduced metrics, and the Trainer broadcasts rank 0's decision so every rank acts alike.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain.checkpoint import files as cf
from polytrain.checkpoint import store as ckpt
from polytrain.errors import SpecError, TrainingFailure
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.spec import objectives as objectives
from polytrain.spec.tables import TrainSpec
from polytrain.spec.user_code import call_user, load_callable, user_name
from polytrain.world import World

HOOKS = ("on_train_start", "on_step_end", "on_validation_end", "on_checkpoint", "on_train_end")


@dataclass(frozen=True)
class RunInfo:
    """What a callback is told about the run it is in."""

    rank: int
    world_size: int
    local_rank: int
    spec: TrainSpec

    stop: Any = field(default=None, repr=False, compare=False)  # the run's `polytrain.train.preemption.StepStop`

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def output(self) -> Path:
        return Path(self.spec.output)

    @property
    def preempt_signal(self) -> str | None:
        """The signal of the spec's ``preemption`` table this rank got (``"SIGTERM"``), or None: once set, the
        run stops at the next step boundary the ranks agree on."""
        return getattr(self.stop, "signal", None)


class Callback:
    """A base class with every hook, doing nothing: override the ones you need."""

    def on_train_start(self, run: RunInfo) -> None: ...

    def on_step_end(self, run: RunInfo, step: int, logs: Mapping[str, Any]) -> None: ...

    def on_validation_end(self, run: RunInfo, epoch: int, logs: Mapping[str, Any]) -> None: ...

    def on_checkpoint(self, run: RunInfo, step: int, path: Path) -> None: ...

    def on_train_end(self, run: RunInfo, result: Any) -> None: ...


def load_callbacks(paths: Iterable[str]) -> list[Any]:
    """``package.module:Class`` → instances made with no arguments (one-line errors naming ``callbacks[i]``)."""
    out = []
    for i, path in enumerate(paths):
        where = f"callbacks[{i}]"
        cls = load_callable(path, where)
        try:
            obj = cls()
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise SpecError(f"{where}: {path}() raised {type(exc).__name__}: {exc}") from exc
        check_callback(obj, where)
        out.append(obj)
    return out


def check_callback(obj: Any, where: str) -> None:
    if not any(callable(getattr(obj, hook, None)) for hook in HOOKS):
        raise SpecError(f"{where}: {type(obj).__name__} has none of the hooks {', '.join(HOOKS)}")


class CallbackList:
    """Calls one hook on every callback that has it, in order."""

    def __init__(self, callbacks: Iterable[Any], run: RunInfo) -> None:
        self.callbacks, self.run = list(callbacks), run

    def call(self, hook: str, *args: Any) -> None:
        """An exception a callback raises is reported by hook, callback class and the user's frames."""
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                call_user(f"callback {hook}", user_name(callback), fn, self.run, *args)


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (NaN never improves)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def check_monitor(field_name: str, monitor: str, logged: Iterable[str]) -> None:
    logged = sorted(logged)
    if monitor not in logged:
        raise SpecError(f"{field_name}: {monitor!r} is not logged by this run (logged: {', '.join(logged)})")


class EarlyStopping:
    """Counts validations without improvement of ``monitor``; ``should_stop`` after ``patience`` of them."""

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float) -> None:
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.waited = 0
        #: whether the run stopped: rank 0's `update` verdict as the Trainer broadcast it (the same on every rank)
        self.stopped = False

    def update(self, logs: Mapping[str, Any]) -> bool:
        """Take one validation's record; returns whether training should stop now."""
        value = float(logs[self.monitor])
        if improved(value, self.best, self.mode, self.min_delta):
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        return self.waited >= self.patience

    def state(self) -> dict[str, Any]:
        """What a checkpoint records (its manifest's ``early_stopping``)."""
        return {"best": self.best, "waited": self.waited, "stopped": self.stopped}

    def load(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.best, self.waited = state.get("best"), int(state.get("waited", 0))
            self.stopped = bool(state.get("stopped"))


class BestCheckpoints:
    """The ``save_top_k`` best checkpoints by ``monitor`` under ``root`` (rank 0 writes; ``index.json`` ranks
    them). The Trainer calls `start` with its run, asks `wants` with the reduced value, writes the checkpoint,
    then calls `keep`.

    An ``index.json`` is taken up only when it ranks the same monitor and mode for the same run (a resumed
    run's own); another one is renamed ``index-<monitor>-<mode>-<time>.json`` at the first `keep`, and the
    checkpoints it ranks are left alone: `keep` removes only what its own index ranked and its run wrote.
    A run resumed from an earlier step goes on from the ranking as it stood there (`start`'s ``resumed_at``).
    A write that fails (a full disk, something in the way) is a `TrainingFailure` naming the index."""

    def __init__(self, root: Path, monitor: str, mode: str, top_k: int) -> None:
        self.root, self.monitor, self.mode, self.top_k = root, monitor, mode, top_k
        self.owner = ckpt.Owner(None)
        self.entries: list[dict[str, Any]] = []
        #: the entries `start` took out of the ranking: a rolled-back run's abandoned future
        self.abandoned: list[dict[str, Any]] = []
        self._foreign: dict[str, Any] | None = None  # an index found that is not this run's ranking

    def start(self, owner: ckpt.Owner, resumed_at: int | None = None) -> Path | None:
        """Take up the index under ``root`` if it is ``owner``'s run's ranking of this monitor and mode.

        A run resumed from step ``resumed_at`` is compared only against the entries of that step and earlier, as
        Lightning restores the top k from the checkpoint it resumes: later ones are the future a rollback abandons
        (weights this run never had). They leave the index, their directories move into
        ``<checkpoint.dir>/abandoned-after-step-<resumed_at>-<time>-<pid>/best/`` (as a rolled-back run's regular
        checkpoints move into an ``abandoned-after-…`` directory), and ``best/latest`` names the newest one left;
        returns that directory (None when nothing moved)."""
        self.owner, self.entries, self.abandoned, self._foreign = owner, [], [], None
        try:
            index = json.loads((self.root / "index.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(index, dict):
            return None
        # an index from before run ids is taken up by a run resumed from that time's checkpoints
        ours = index[ckpt.RUN_KEY] == owner.run_id if ckpt.RUN_KEY in index else owner.legacy_digest is not None
        best = index.get("best")
        if not (ours and (index.get("monitor"), index.get("mode")) == (self.monitor, self.mode)
                and isinstance(best, list)):
            self._foreign = index
            return None
        self.entries = [e for e in best if isinstance(e, dict) and {"path", "value"} <= set(e)]
        return self._set_aside_future(resumed_at) if resumed_at is not None else None

    def _set_aside_future(self, step: int) -> Path | None:
        self.abandoned = [e for e in self.entries if (s := entry_step(e)) is not None and s > step]
        if not self.abandoned:
            return None
        self.entries = [e for e in self.entries if e not in self.abandoned]
        self._write_index()  # the kept ranking first: a crash after it leaves unranked checkpoints, never a
        # ranking of missing ones
        future = [path for e in self.abandoned if (path := self.root / e["path"]).is_dir()
                  and self.owner.owns(ckpt.read_manifest(path))]  # never another run's, whatever an index says
        try:
            aside = ckpt.move_aside(self.root.parent, future, f"abandoned-after-{ckpt.step_dir_name(step)}")
            self._point_latest(step)
        except OSError as exc:
            raise TrainingFailure(f"checkpoint.dir: cannot set aside the best checkpoints after step {step} in "
                                  f"{self.root} ({_reason(exc)}); free space or choose another checkpoint.dir, "
                                  "then resume again") from exc
        return aside

    def _point_latest(self, step: int) -> None:
        """``latest`` names the newest checkpoint left of ``step`` or earlier (none left: it goes)."""
        latest = self.root / "latest"
        kept = [p for p in ckpt.complete_checkpoints(self.root) if int(p.name.removeprefix("step-")) <= step]
        if not kept:
            latest.unlink(missing_ok=True)
            return
        pointer = self.root / f".latest.tmp-{os.getpid()}"
        cf.write_file(pointer, (kept[-1].name + "\n").encode())
        os.replace(pointer, latest)
        cf.fsync_dir(self.root)

    def _ranked(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(entries, key=lambda e: e["value"], reverse=self.mode == "max")

    def wants(self, value: float) -> bool:
        """Whether a checkpoint whose monitored value is ``value`` is among the best (a non-finite value never
        is: a diverged run's checkpoint is not one to keep, and the index holds finite numbers only)."""
        if not math.isfinite(value):
            return False
        if len(self.entries) < self.top_k:
            return True
        return improved(value, self._ranked(self.entries)[-1]["value"], self.mode)

    def keep(self, path: Path, step: int, epoch: int, value: float) -> list[Path]:
        """Record the new checkpoint, remove those no longer among the best; returns the removed paths."""
        others = [e for e in self.entries if e["path"] != path.name]
        ranked = self._ranked([*others, {"path": path.name, "step": step, "epoch": epoch, "value": value}])
        self.entries, dropped = ranked[:self.top_k], ranked[self.top_k:]
        if self._foreign is not None and (self.root / "index.json").is_file():
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            name = f"index-{self._foreign.get('monitor')}-{self._foreign.get('mode')}-{stamp}.json"
            try:
                (self.root / "index.json").replace(self.root / name)
            except OSError as exc:
                raise self._failure(exc) from exc
        self._foreign = None
        self._write_index()
        removed = []
        for entry in dropped:
            target = self.root / entry["path"]
            if self.owner.owns(ckpt.read_manifest(target)):  # never another run's, whatever an index says
                shutil.rmtree(target, ignore_errors=True)
                removed.append(target)
        return removed

    def _write_index(self) -> None:
        """``index.json`` replaced whole by the ranking as it is now (a failed write leaves the previous one)."""
        index = {"monitor": self.monitor, "mode": self.mode, ckpt.RUN_KEY: self.owner.run_id, "best": self.entries}
        tmp = self.root / "index.json.tmp"
        try:
            tmp.write_text(jsonfiles.dumps(index, indent=2))
            tmp.replace(self.root / "index.json")
        except OSError as exc:
            if tmp.is_file():
                tmp.unlink(missing_ok=True)
            raise self._failure(exc) from exc

    def _failure(self, exc: OSError) -> TrainingFailure:
        index = self.root / "index.json"
        return TrainingFailure(f"checkpoint.dir: cannot write {index}, the best checkpoints' ranking "
                               f"({_reason(exc, index)}); the checkpoints it ranks are intact; free space or choose "
                               "another checkpoint.dir, then resume with --resume auto")


def entry_step(entry: Mapping[str, Any]) -> int | None:
    """The step of a best checkpoint's index entry, read from its directory's name (None: not a step directory)."""
    match = ckpt.STEP_DIR.match(str(entry.get("path")))
    return int(match.group(1)) if match else None


def _reason(exc: OSError, about: Path | None = None) -> str:
    """An OSError in a few words, with the path it failed on where that is not ``about``."""
    reason = exc.strerror or str(exc)
    where = exc.filename2 or exc.filename
    return f"{reason}: {where}" if where is not None and Path(where) != about else reason


@dataclass
class RunHooks:
    """What a run calls back into: the callbacks, and early stopping and the best checkpoints when the spec
    asks for them (`set_up_callbacks`)."""

    callbacks: CallbackList
    early_stopping: EarlyStopping | None = None
    best: BestCheckpoints | None = None

    @property
    def stopped_early(self) -> bool:
        return self.early_stopping is not None and self.early_stopping.stopped


def set_up_callbacks(spec: TrainSpec, world: World, extra: Iterable[Any], task: str, validated: bool,
                     stop: Any = None) -> RunHooks:
    """The spec's callbacks then ``extra`` (the caller's objects), early stopping and the best checkpoints of a
    run of ``task``, which has validation data when ``validated``. Monitored names are checked against what this
    run logs: one-line errors before anything is built."""
    extra = list(extra)
    for i, obj in enumerate(extra):
        check_callback(obj, f"callbacks[{i}]")
    run = RunInfo(world.rank, world.size, world.local_rank, spec, stop)
    hooks = RunHooks(CallbackList([*load_callbacks(spec.callbacks or ()), *extra], run))
    metrics = objectives.metric_names(spec.metrics, task)
    val_names = {"val_loss", *(f"val_{objectives.metric_key(m)}" for m in metrics)}
    logged = {"train_loss", *(val_names if validated else ())}
    stopping, ck = spec.loop.early_stopping, spec.checkpoint
    for field_name, monitor in (("loop.early_stopping.monitor", stopping.monitor), ("checkpoint.monitor", ck.monitor)):
        if monitor in val_names and not validated:
            raise SpecError(f"{field_name}: {monitor!r} needs validation data and this run has none "
                            f"(data.val_fraction is 0 and no validation set was given); monitor train_loss, or "
                            f"set data.val_fraction above 0")
    if stopping.monitor is not None:
        check_monitor("loop.early_stopping.monitor", stopping.monitor, logged)
        hooks.early_stopping = EarlyStopping(stopping.monitor, stopping.mode, stopping.patience, stopping.min_delta)
    if ck.monitor is not None:
        check_monitor("checkpoint.monitor", ck.monitor, logged)
        hooks.best = BestCheckpoints(spec.checkpoint_dir / "best", ck.monitor, ck.mode, ck.save_top_k)
    return hooks

"""What the two own-loop APIs (`polytrain.torch.Distributed`, `polytrain.tensorflow.Distributed`) share, with no
framework imported: who and where this rank is, printing on rank 0, the reduction's numbers, and the lifetime —
`end` (also at exit and at the end of a with-block) meets the other ranks at a barrier, then tears the backend
down, so nothing the object started outlives it; on an error, or at exit, it skips the barrier (a failing rank
must not wait for ranks stuck in a collective)."""

from __future__ import annotations

import atexit
import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from polytrain.errors import OwnLoopError
from polytrain.train.preemption import NO_STOP, start_stop

if TYPE_CHECKING:
    from polytrain.loop.checkpoints import Loaded

REDUCE_OPS = ("sum", "mean", "max", "min")


class LoopSession:
    """The base of both `Distributed` classes: they set ``world``, ``backend`` and ``_ended`` when they start,
    call `_hold` once the backend is set up, and put their own clean-up in `_release`."""

    world: Any
    backend: Any
    spec: Any
    _ended: bool = False
    _trackers: Any = None  # the spec's trackers (logging.wandb, logging.mlflow), started by the first `log`
    _resumed_trackers: dict[str, str] = {}  # the tracker runs a loaded checkpoint kept
    _owner: Any  # the run whose checkpoints `save` may replace and prune (`polytrain.checkpoint.store.Owner`)
    _stop: Any = NO_STOP  # the spec's preemption table at work (`polytrain.train.preemption.StepStop`)
    _stop_calls = 0

    def _hold(self) -> None:
        atexit.register(self._end_at_exit)

    @contextlib.contextmanager
    def _setting_up(self) -> Iterator[None]:
        """Around the backend's set-up: the spec's preemption signals are handled from its start (a signal during
        the rendezvous counts at the first agreement), and put back as they were when the set-up fails."""
        self._stop = start_stop(self.spec.preemption, self.world.rank, "the folder the loop saves to")
        self._stop_calls = 0
        try:
            yield
        except BaseException:
            self._stop.close()
            raise

    # ------------------------------------------------------------------ preemption
    def preempted(self, step: int | None = None, *, every_n_steps: int | None = None) -> bool:
        """Whether the loop must stop here because a rank got one of the spec's ``preemption`` signals: the same
        answer on every rank. Every rank calls it once per step, at the step boundary (``step``: the loop's own
        number, for the last line). The ranks agree every ``every_n_steps`` calls (default: the spec's
        ``loop.log_every_n_steps``) in one small all-reduce; the calls between are a flag test. On True: save
        (every rank, `save`), then `exit_preempted`. Always False without a ``preemption`` table."""
        self._check_open("preempted")
        if self._stop.spec is None:
            return False
        every = self.spec.loop.log_every_n_steps if every_n_steps is None else every_n_steps
        if not isinstance(every, int) or every < 1:
            raise OwnLoopError(f"preempted: every_n_steps must be a whole number >= 1, got {every_n_steps!r}")
        self._stop_calls += 1
        at = self._stop_calls if step is None else step
        if self._stop_calls % every == 0 or self._stop.stop_step is not None:
            if self._stop.stop_step is None:
                signalled = float(self._reduce(np.array([self._stop.asked]), "sum")[0])
                self._stop.heard(signalled, at)
            return self._stop.due(at)
        return False

    def exit_preempted(self, saved_step: int | None = None) -> NoReturn:
        """After `preempted` said True and the loop saved: end this object (the ranks meet, the group ends), ask
        Slurm to requeue the job where the table says so (rank 0), print one line on rank 0 and exit with code
        `polytrain.spec.preemption.PREEMPTED_EXIT` (75): stopped, resumable."""
        if not self._stop.stopped:
            raise OwnLoopError("exit_preempted: preempted() has not said True on this rank")
        stopped = self._stop.end(saved_step, resume="load the loop's last save to go on (Distributed.load)")
        self.end()
        if stopped.show:
            print(f"polytrain: {stopped}", file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)

    # ------------------------------------------------------------------ who and where
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs)
            (kwargs.get("file") or sys.stdout).flush()

    def _reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        """``values`` (float64) reduced over the ranks by the backend: sum, mean, max or min."""
        if op not in REDUCE_OPS:
            raise OwnLoopError(f"all_reduce: op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        reduced = np.asarray(self.backend.all_reduce(values, "sum" if op == "mean" else op))
        return reduced / self.world.size if op == "mean" else reduced

    def log(self, values: Mapping[str, Any], step: int) -> None:
        """Log ``values`` (numbers or one-element tensors, by name) at ``step`` to the trackers the spec's ``logging``
        names (W&B, MLflow), on rank 0; every rank calls it. The first call starts them — in the tracker runs a
        checkpoint loaded before it kept, so a resumed loop goes on in the same run — or ends every rank with one
        line naming ``logging.<name>`` when one cannot start. `end` finishes them."""
        self._check_open("log")
        if self._trackers is None:
            from polytrain.observe.trackers import start_for_run

            self._trackers = start_for_run(self.spec, self.world, self.backend, self._resumed_trackers)
        if self._trackers.runs:
            self._trackers.log({name: float(value.item() if hasattr(value, "item") else value)
                                for name, value in values.items()}, int(step))

    def tracker_ids(self) -> dict[str, str]:
        """The started trackers' run ids by tracker name (what a checkpoint keeps; empty before the first `log`)."""
        return self._trackers.ids() if self._trackers is not None else {}

    def _resumed(self, loaded: Loaded) -> dict[str, Any]:
        """Go on as the run a load read (`polytrain.loop.checkpoints.Loaded`): its later saves may replace and prune
        its checkpoints, and `log` goes on in its tracker runs. Returns its values."""
        if loaded.owner is not None:
            self._owner = loaded.owner
        self._resumed_trackers = dict(loaded.trackers)
        return loaded.values

    # ------------------------------------------------------------------ lifetime
    def end(self) -> None:
        """Stop what this object started (process group, stores, wrappers); idempotent, also run at exit."""
        self._end(meet=True)

    def _end_at_exit(self) -> None:
        # the script may be ending on an error (the interpreter then has printed it: sys.last_value), with the
        # other ranks in a collective
        self._end(meet=False, failed=hasattr(sys, "last_value"))

    def _release(self) -> None:
        """What a framework's own object lets go of first (its model and optimizer, its watch, its policy)."""

    def _end(self, meet: bool, failed: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self._stop.close()  # the previous signal handlers back (kept till the exit once the loop stopped)
        atexit.unregister(self._end_at_exit)  # the exit hook held this object (and its backend) for the process's life
        if self._trackers is not None:
            self._trackers.finish(failed=failed)
        self._release()
        # Every rank past its last collective before any tears down, with the GIL let go while it waits: gloo's
        # workers finish freeing that collective's tensors (which needs the GIL) now. Otherwise a script's DDP
        # model, a group's last holder once it is torn down, could free it later with the GIL held, joining a
        # worker that waits for the GIL: both ranks hung, ~1 run in 5 of two sessions in one process.
        try:
            if meet and self.world.size > 1:
                self.backend.barrier()
        finally:  # a barrier that fails (a rank gone) must not keep the group and its threads alive
            self.backend.teardown()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end(meet=exc[0] is None, failed=exc[0] is not None)

    def _check_open(self, verb: str) -> None:
        if self._ended:
            raise OwnLoopError(f"{verb}: this Distributed has ended")

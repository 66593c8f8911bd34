"""What the two own-loop APIs (`polytrain.torch.Distributed`, `polytrain.tensorflow.Distributed`) share, with no
framework imported: who and where this rank is, printing on rank 0, the reduction's numbers, and the lifetime —
`end` (also at exit and at the end of a with-block) meets the other ranks at a barrier, then tears the backend
down, so nothing the object started outlives it; on an error, or at exit, it skips the barrier (a failing rank
must not wait for ranks stuck in a collective)."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from polytrain.errors import OwnLoopError

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

    def _hold(self) -> None:
        atexit.register(self._end_at_exit)

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

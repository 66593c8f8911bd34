"""What the two own-loop APIs (`polytrain.torch.Distributed`, `polytrain.tensorflow.Distributed`) share, with no
framework imported: who and where this rank is, printing on rank 0, the reduction's numbers, and the lifetime —
`end` (also at exit and at the end of a with-block) meets the other ranks at a barrier, then tears the backend
down, so nothing the object started outlives it; on an error, or at exit, it skips the barrier (a failing rank
must not wait for ranks stuck in a collective)."""

from __future__ import annotations

import atexit
import sys
from typing import Any

import numpy as np

from polytrain.errors import OwnLoopError

REDUCE_OPS = ("sum", "mean", "max", "min")


class LoopSession:
    """The base of both `Distributed` classes: they set ``world``, ``backend`` and ``_ended`` when they start,
    call `_hold` once the backend is set up, and put their own clean-up in `_release`."""

    world: Any
    backend: Any
    _ended: bool = False

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

    # ------------------------------------------------------------------ lifetime
    def end(self) -> None:
        """Stop what this object started (process group, stores, wrappers); idempotent, also run at exit."""
        self._end(meet=True)

    def _end_at_exit(self) -> None:
        self._end(meet=False)  # the script may be ending on an error, with the other ranks in a collective

    def _release(self) -> None:
        """What a framework's own object lets go of first (its model and optimizer, its watch, its policy)."""

    def _end(self, meet: bool) -> None:
        if self._ended:
            return
        self._ended = True
        atexit.unregister(self._end_at_exit)  # the exit hook held this object (and its backend) for the process's life
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
        self._end(meet=exc[0] is None)

    def _check_open(self, verb: str) -> None:
        if self._ended:
            raise OwnLoopError(f"{verb}: this Distributed has ended")

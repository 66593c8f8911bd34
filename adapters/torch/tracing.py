"""Every torch.distributed collective of a run on the timeline, for backends whose collectives are
issued inside a library (FSDP2, DeepSpeed) rather than through a hook polytrain owns (DDP's comm hook,
the MPI and Horovod backends' own buckets).

While installed, the collective functions of ``torch.distributed`` are replaced by wrappers that
record each call's start, its end (for ``async_op=True``: when its work completes, through the work's
future) and its bytes — the largest tensor it was given, i.e. what one rank reduces, gathers or
broadcasts in full. A reduction issued during a backward pass is a *gradient bucket* (named
``gradient bucket <k>``, counted per backward pass); every other call is named by its operation
(``all_gather``: FSDP's and ZeRO-3's parameter gathers, ZeRO-1/2's gather of updated partitions).
The libraries look the functions up on the module at call time or when they start (DeepSpeed), so
the backend installs the tracer before starting them, and removes it at teardown.

Not installed unless a timeline was asked for: the untraced run calls torch's functions directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from polytrain.observe.timeline import COLLECTIVES

#: torch.distributed's name → the operation recorded (names differ across torch releases).
TRACED = {
    "all_reduce": "allreduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
}
REDUCTIONS = {"allreduce", "reduce_scatter"}


def _largest_bytes(values: Any) -> int:
    best = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            best = max(best, value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)):
            best = max(best, sum(t.numel() * t.element_size() for t in value if isinstance(t, torch.Tensor)))
    return best


class CollectiveTracer:
    """Records every torch.distributed collective on ``timeline`` until `remove`."""

    def __init__(self, timeline: Any, activity: Any) -> None:
        self.timeline, self.activity = timeline, activity
        self._originals: dict[str, Callable[..., Any]] = {}
        self._bucket_seq: Any = None
        self._buckets = 0

    def install(self) -> CollectiveTracer:
        for name, op in TRACED.items():
            original = getattr(dist, name, None)
            if original is not None and name not in self._originals:
                self._originals[name] = original
                setattr(dist, name, self._wrap(original, op))
        return self

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _label(self, op: str) -> str:
        text = getattr(self.activity, "text", "")
        if op not in REDUCTIONS or not text.startswith("backward"):
            return op
        seq = getattr(self.activity, "seq", None)
        if seq != self._bucket_seq:  # a new backward pass: buckets count from 0 again
            self._bucket_seq, self._buckets = seq, 0
        self._buckets += 1
        return f"gradient bucket {self._buckets - 1}"

    def _wrap(self, original: Callable[..., Any], op: str) -> Callable[..., Any]:
        timeline = self.timeline

        def traced(*args: Any, **kwargs: Any) -> Any:
            name, nbytes = self._label(op), _largest_bytes([*args, *kwargs.values()])
            started = timeline.now()
            work = original(*args, **kwargs)
            future = None
            if work is not None and hasattr(work, "get_future"):
                try:
                    future = work.get_future()
                except RuntimeError:  # a backend without futures: the call's return is the best end we have
                    future = None
            if future is None:
                timeline.complete(name, "collective", started, timeline.now(), track=COLLECTIVES, op=op,
                                  bytes=nbytes)
            else:
                future.then(lambda _: timeline.complete(name, "collective", started, timeline.now(),
                                                        track=COLLECTIVES, op=op, bytes=nbytes))
            return work

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

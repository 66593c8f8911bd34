"""Reading batches ahead of the training loop, in background threads.

Threads, not processes: the readers spend their time in pyarrow, Pillow, numpy and file reads,
which release the GIL, and a thread hands its batch over without pickling (processes would copy
every batch through a pipe; ``bench/data_throughput.py`` measures the readers). What a batch holds
depends only on the plan and the seeds — each micro-batch's augmentation and transform get a
Generator seeded by (seed, epoch, step, micro-step) — never on which thread read it or when.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from polytrain.data.plan import StepPlan
from polytrain.data.source import Source
from polytrain.errors import SpecError
from polytrain.user_code import load_callable

Batch = tuple[np.ndarray, np.ndarray]
BatchFn = Callable[[np.ndarray, np.ndarray, np.random.Generator], Batch]


def load_transform(path: str | None, field_name: str = "data.transform") -> BatchFn | None:
    """``package.module:function`` as a batch function taking ``(x, y, rng)`` (the user's may omit ``rng``)."""
    if path is None:
        return None
    fn = load_callable(path, field_name)
    try:
        takes_rng = "rng" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_rng = False
    if takes_rng:
        return lambda x, y, rng: fn(x, y, rng=rng)
    return lambda x, y, rng: fn(x, y)


class Prefetcher:
    """Reads the micro-batches of the coming steps in ``workers`` threads, up to ``depth`` steps ahead."""

    def __init__(self, workers: int, depth: int, seed: int, augment: BatchFn | None = None,
                 transform: BatchFn | None = None, transform_name: str = "data.transform") -> None:
        self.depth, self.seed = depth, seed
        self.augment, self.transform, self.transform_name = augment, transform, transform_name
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="polytrain-data") if workers > 0 else None

    def read(self, source: Source, indices: np.ndarray, key: Sequence[int], train: bool) -> Batch:
        """One batch: read, then (training only) augment, then the user's transform; ``key`` seeds both."""
        x, y = source.read(indices)
        if self.augment is None and self.transform is None:
            return x, y
        rng = np.random.default_rng([self.seed, *key])  # key: (0, epoch, step, micro) or (1, epoch, batch)
        if train and self.augment is not None:
            x, y = self.augment(x, y, rng)
        if self.transform is not None:
            try:
                out = self.transform(x, y, rng)
                x, y = out
            except SpecError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's code: say whose it is
                raise SpecError(f"{self.transform_name}: raised {type(exc).__name__}: {exc}") from exc
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                raise SpecError(f"{self.transform_name}: must return (x, y) numpy arrays, got "
                                f"({type(x).__name__}, {type(y).__name__})")
        return x, y

    def _submit(self, fn: Callable[..., Batch], *args: Any) -> Future[Batch] | Batch:
        return self._pool.submit(fn, *args) if self._pool is not None else fn(*args)

    @staticmethod
    def _result(item: Future[Batch] | Batch) -> Batch:
        return item.result() if isinstance(item, Future) else item

    def steps(self, source: Source, plans: Iterable[tuple[int, StepPlan]], epoch: int
              ) -> Iterator[tuple[StepPlan, list[Batch]]]:
        """``(step number, plan)`` pairs → ``(plan, its micro-batches)``, in order, read ahead."""
        pending: collections.deque[tuple[StepPlan, list[Future[Batch] | Batch]]] = collections.deque()
        plans = iter(plans)
        try:
            while True:
                while len(pending) < (self.depth if self._pool is not None else 1):
                    nxt = next(plans, None)
                    if nxt is None:
                        break
                    step, plan = nxt
                    pending.append((plan, [self._submit(self.read, source, idx, (0, epoch, step, m), True)
                                           for m, idx in enumerate(plan.micro_batches)]))
                if not pending:
                    return
                plan, batches = pending.popleft()
                yield plan, [self._result(b) for b in batches]
        finally:
            for _, batches in pending:
                for b in batches:
                    if isinstance(b, Future):
                        b.cancel()

    def batches(self, source: Source, index_batches: Sequence[np.ndarray], epoch: int) -> Iterator[Batch]:
        """Evaluation batches, read ahead (no augmentation), at most ``depth`` × 2 in flight."""
        pending: collections.deque[Future[Batch] | Batch] = collections.deque()
        try:
            for i, idx in enumerate(index_batches):
                pending.append(self._submit(self.read, source, idx, (1, epoch, i), False))
                if len(pending) >= 2 * self.depth:
                    yield self._result(pending.popleft())
            while pending:
                yield self._result(pending.popleft())
        finally:
            for item in pending:
                if isinstance(item, Future):
                    item.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

"""Reading batches ahead of the training loop, in background threads (a source held in memory with nothing to
run on its batches, such as the built-in datasets and arrays given to ``fit``, is read where the batch is used).

Threads, not processes: the readers spend their time in pyarrow, Pillow, numpy and file reads,
which release the GIL, and a thread hands its batch over without pickling (processes would copy
every batch through a pipe; ``bench/data_throughput.py`` measures the readers). What a batch holds
depends only on the plan and the seeds, never on which thread read it or when.

Randomness is per sample: each sample's augmentation and the user's transform draw from that sample's
own Generator, seeded by (seed, epoch, the sample's index in its source) (`sample_rngs`). A sample is
therefore augmented alike at every world size, micro-batch split and resume point, and two ranks' samples
draw differently.
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
from polytrain.spec.user_code import call_user, load_callable, user_name

Batch = tuple[np.ndarray, np.ndarray]
Rngs = Sequence[np.random.Generator]
#: ``(x, y, rngs) -> (x, y)``: ``rngs[i]`` is sample ``i``'s Generator (see `sample_rngs`)
BatchFn = Callable[[np.ndarray, np.ndarray, Rngs], Batch]

#: the stream tags of `sample_rngs`: every key has the same length, so no two streams share a seed
#: (numpy pads a short entropy list with zeros: ``[a, b]`` and ``[a, b, 0]`` seed alike)
TRAINING, VALIDATION = 0, 1


def sample_rngs(seed: int, stream: int, epoch: int, indices: np.ndarray) -> list[np.random.Generator]:
    """One Generator per sample, seeded by (seed, stream, epoch, the sample's index in its source)."""
    return [np.random.default_rng([seed, stream, epoch, int(i)]) for i in indices]


class Transform:
    """The user's ``data.transform``, with the per-sample randomness contract.

    A function taking ``rng`` runs once per sample (a batch of one, ``x[i:i+1], y[i:i+1]``, with
    ``rng=`` that sample's Generator) and the rows are concatenated; one taking ``rngs`` gets the whole
    batch and the list of its samples' Generators; one taking neither runs once on the whole batch.
    Either way a sample's draws do not depend on the batch it lands in.
    """

    def __init__(self, fn: Callable[..., Any], name: str = "data.transform") -> None:
        self.fn, self.name = fn, name
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        self.kind = "rngs" if "rngs" in parameters else "rng" if "rng" in parameters else "batch"

    @property
    def needs_rngs(self) -> bool:
        return self.kind != "batch"

    def __call__(self, x: np.ndarray, y: np.ndarray, rngs: Rngs | None) -> Batch:
        if self.kind == "batch":
            return self._checked(self.fn(x, y))
        assert rngs is not None
        if self.kind == "rngs":
            return self._checked(self.fn(x, y, rngs=list(rngs)))
        if len(x) == 0:  # an empty micro-batch (the last step's) still takes the transform's shapes
            return self._checked(self.fn(x, y, rng=np.random.default_rng(0)))
        rows = [self._checked(self.fn(x[i:i + 1], y[i:i + 1], rng=rng)) for i, rng in enumerate(rngs)]
        return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])

    def _checked(self, out: Any) -> Batch:
        x, y = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
            got = f"({type(x).__name__}, {type(y).__name__})" if y is not None else f"a {type(out).__name__}"
            raise SpecError(f"{self.name}: must return (x, y) numpy arrays, got {got}")
        return x, y


def load_transform(path: str | None, field_name: str = "data.transform") -> Transform | None:
    """``package.module:function`` as a `Transform` (``(x, y)``, ``(x, y, rng=)`` or ``(x, y, rngs=)``)."""
    if path is None:
        return None
    return Transform(load_callable(path, field_name), field_name)


class Prefetcher:
    """Reads the micro-batches of the coming steps in ``workers`` threads, up to ``depth`` steps ahead."""

    def __init__(self, workers: int, depth: int, seed: int, augment: BatchFn | None = None,
                 transform: Transform | None = None, transform_name: str = "data.transform") -> None:
        self.depth, self.seed = depth, seed
        self.augment, self.transform, self.transform_name = augment, transform, transform_name
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="polytrain-data") if workers > 0 else None

    def read(self, source: Source, indices: np.ndarray, epoch: int, train: bool) -> Batch:
        """One batch: read, then (training only) augment, then the user's transform; both draw from the
        samples' Generators (`sample_rngs`: ``indices`` are the samples' indices in ``source``). A source that
        ``augments_while_decoding`` gets the augmentation's draws with the read and applies them itself."""
        augment = self.augment if train else None
        if augment is None and self.transform is None:
            return source.read(indices)
        rngs = None
        if augment is not None or self.transform.needs_rngs:  # type: ignore[union-attr]
            rngs = sample_rngs(self.seed, TRAINING if train else VALIDATION, epoch, indices)
        if hasattr(augment, "draws") and getattr(source, "augments_while_decoding", False):
            x, y = source.read(indices, draws=augment.draws(rngs))  # type: ignore[attr-defined, call-arg]
        else:
            x, y = source.read(indices)
            if augment is not None:
                x, y = augment(x, y, rngs)  # type: ignore[arg-type]
        if self.transform is not None:
            x, y = self._transform(x, y, rngs)
        return x, y

    def _transform(self, x: np.ndarray, y: np.ndarray, rngs: Rngs | None) -> Batch:
        assert self.transform is not None
        return call_user(self.transform_name, user_name(self.transform.fn), self.transform, x, y, rngs)

    def _threads(self, source: Source) -> ThreadPoolExecutor | None:
        """The pool that reads ``source`` ahead, or None to read where the batch is used: a source held in memory
        with nothing to run on its batches is read in a few array copies, less than a hand-off to a thread and
        back, and the thread would only compete with the training step for the cores."""
        inline = getattr(source, "in_memory", False) and self.augment is None and self.transform is None
        return None if inline else self._pool

    @staticmethod
    def _submit(pool: ThreadPoolExecutor | None, fn: Callable[..., Batch], *args: Any) -> Future[Batch] | Batch:
        return pool.submit(fn, *args) if pool is not None else fn(*args)

    @staticmethod
    def _result(item: Future[Batch] | Batch) -> Batch:
        return item.result() if isinstance(item, Future) else item

    def steps(self, source: Source, plans: Iterable[tuple[int, StepPlan]], epoch: int
              ) -> Iterator[tuple[StepPlan, list[Batch]]]:
        """``(step number, plan)`` pairs → ``(plan, its micro-batches)``, in order, read ahead."""
        pending: collections.deque[tuple[StepPlan, list[Future[Batch] | Batch]]] = collections.deque()
        plans = iter(plans)
        pool = self._threads(source)
        try:
            while True:
                while len(pending) < (self.depth if pool is not None else 1):
                    nxt = next(plans, None)
                    if nxt is None:
                        break
                    _, plan = nxt
                    pending.append((plan, [self._submit(pool, self.read, source, idx, epoch, True)
                                           for idx in plan.micro_batches]))
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
        pool = self._threads(source)
        try:
            for idx in index_batches:
                pending.append(self._submit(pool, self.read, source, idx, epoch, False))
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

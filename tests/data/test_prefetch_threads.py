"""Where the Prefetcher reads: a source on files in its threads, ahead of the step; a source held in memory with
nothing to run on its batches where the batch is used (a thread would only compete with the step for cores)."""

from __future__ import annotations

import threading

import numpy as np

from polytrain.data.plan import epoch_plan
from polytrain.data.prefetch import Prefetcher
from polytrain.data.source import ArraySource, Subset


class Recording(ArraySource):
    def __init__(self, x: np.ndarray, y: np.ndarray, in_memory: bool) -> None:
        super().__init__(x, y)
        self.in_memory, self.threads = in_memory, set()  # type: ignore[misc]

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.threads.add(threading.current_thread().name)
        return super().read(indices)


def read_epoch(source: object, prefetcher: Prefetcher) -> list[np.ndarray]:
    plans = epoch_plan(len(source), seed=0, epoch=0, global_batch=8,  # type: ignore[arg-type]
                       world_size=1, rank=0, accum=1, order=source.order(0, 0))  # type: ignore[attr-defined]
    out = [x for _, batches in prefetcher.steps(source, enumerate(plans), 0) for x, _ in batches]  # type: ignore[arg-type]
    out += [x for x, _ in prefetcher.batches(source, [np.arange(8), np.arange(8, 16)], 0)]  # type: ignore[arg-type]
    return out


def test_in_memory_sources_are_read_in_place_and_file_sources_ahead_in_threads() -> None:
    x, y = np.arange(64, dtype=np.float32).reshape(32, 2), np.arange(32)
    prefetcher = Prefetcher(workers=2, depth=2, seed=0)
    try:
        memory, files = Recording(x, y, in_memory=True), Recording(x, y, in_memory=False)
        same = read_epoch(memory, prefetcher)
        for a, b in zip(same, read_epoch(files, prefetcher), strict=True):
            np.testing.assert_array_equal(a, b)
        assert memory.threads == {threading.current_thread().name}
        assert files.threads and all(name.startswith("polytrain-data") for name in files.threads)
        split = Subset(Recording(x, y, in_memory=True), np.arange(0, 32, 2))
        read_epoch(split, prefetcher)
        assert split.parent.threads == {threading.current_thread().name}  # type: ignore[attr-defined]
        # with work to run on its batches (an augmentation here), an in-memory source is read ahead in threads too
        transformed = Recording(x, y, in_memory=True)
        ahead = Prefetcher(workers=2, depth=2, seed=0, augment=lambda x, y, rngs: (x, y))
        read_epoch(transformed, ahead)
        ahead.close()
        assert all(name.startswith("polytrain-data") for name in transformed.threads)
    finally:
        prefetcher.close()

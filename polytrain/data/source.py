"""What the Trainer reads samples through: a map-style `Source`, a split of one into train and
validation (`Subset`), and the pair with its `DatasetInfo` (`Data`).

A source reads a list of sample indices into one numpy batch ``(x, y)``; nothing holds the whole
dataset unless the source is small by construction (`ArraySource`). Its ``order(seed, epoch)`` is
the epoch's sample order, a permutation of ``range(len(source))`` that depends only on
(seed, epoch): a full shuffle for sources with cheap random access, a shuffle of blocks then of
the samples inside a window of blocks for sources read in blocks (Parquet row groups). The one
planner (`polytrain.data.plan.epoch_plan`) cuts that order into steps, ranks and micro-steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from polytrain.data.plan import shuffled, split_indices
from polytrain.errors import SpecError


@dataclass(frozen=True)
class DatasetInfo:
    """What a model is built for: one sample's shape, the outputs and the task."""

    input_shape: tuple[int, ...]  # one sample, e.g. (64,) for digits
    num_outputs: int  # classes, or 1 for regression
    task: str  # "classification" | "regression" | "next_token"
    image_shape: tuple[int, int, int] | None = None  # (channels, height, width) when samples are images


class Source(Protocol):
    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples at ``indices`` (in that order) as one batch; thread-safe."""
        ...

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's sample order: a permutation of ``range(len(self))``, a function of (seed, epoch) only."""
        ...


@dataclass(frozen=True)
class Data:
    """A job's training and validation samples."""

    train: Source
    val: Source
    info: DatasetInfo
    #: what the exactly-once and ordering guarantee of ``train`` is, in words (for the log)
    guarantee: str = "every sample once per epoch, fully shuffled"
    #: seeded augmentation of training batches, ``(x, y, rngs) -> (x, y)``, run in the data workers; ``rngs[i]``
    #: is sample i's numpy Generator, seeded by (seed, epoch, its index in ``train``); None: none. A source whose
    #: ``augments_while_decoding`` is true takes the augmentation's ``draws(rngs)`` in ``read(indices, draws)``
    #: instead and applies them to what it decodes (the image sources: `polytrain.data.images.ImageAugment`)
    augment: Callable[[np.ndarray, np.ndarray, Sequence[np.random.Generator]],
                      tuple[np.ndarray, np.ndarray]] | None = None


class ArraySource:
    """Samples held in memory as two arrays (the built-in small datasets, or arrays passed to `fit`)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(x) != len(y):
            raise SpecError(f"data: x and y must have the same length (x: {len(x)}, y: {len(y)})")
        self.x, self.y = x, y

    #: a read is an array copy: the Prefetcher reads it where the batch is used, with no thread
    in_memory = True

    def __len__(self) -> int:
        return len(self.x)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return shuffled(len(self.x), seed, epoch)


class Subset:
    """The samples of ``parent`` at ``indices`` (sorted), for a seeded train/validation split.

    Its order follows the parent's: the parent's order restricted to these samples, so a source read
    in blocks keeps its locality.
    """

    def __init__(self, parent: Source, indices: np.ndarray) -> None:
        self.parent = parent
        self.indices = np.sort(np.asarray(indices, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def in_memory(self) -> bool:
        return bool(getattr(self.parent, "in_memory", False))

    @property
    def augments_while_decoding(self) -> bool:
        return bool(getattr(self.parent, "augments_while_decoding", False))

    def read(self, indices: np.ndarray, draws: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if draws is None:
            return self.parent.read(self.indices[indices])
        return self.parent.read(self.indices[indices], draws=draws)  # type: ignore[call-arg]

    def order(self, seed: int, epoch: int) -> np.ndarray:
        position = np.full(len(self.parent), -1, dtype=np.int64)
        position[self.indices] = np.arange(len(self.indices))
        mapped = position[self.parent.order(seed, epoch)]
        return mapped[mapped >= 0]


def split(source: Source, val_fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, validation): ``val_fraction`` of the samples, chosen by a permutation seeded with ``seed``."""
    train, val = split_indices(len(source), val_fraction, seed)
    return Subset(source, train), Subset(source, val)

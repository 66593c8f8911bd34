"""The own-loop API's data side: loaders re-made to read one rank's shard, and the exact gather for metrics.

`sharded` gives a loader a `DistributedSampler` (shuffled with the job's seed when the original shuffled, the
epoch moved on at every pass). Such a sampler evens out the ranks' shares by repeating samples from the start
of the order: with N samples on W ranks, rank r's j-th sample is place r + j·W of the padded order, and places
from N on are the copies. While a loop runs over such a loader, `Loading.place` says where the current batch
sits, and `gather` drops the copies and puts the ranks' rows back in the order's places: the result is each
sample exactly once, as one process would have read them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from polytrain.torch.errors import OwnLoopError


@dataclass(frozen=True)
class BatchPlace:
    """Where the current batch of a sharded loader sits: ``total`` samples in the set (None: the sampler drops
    the tail, so there are no copies), ``world`` ranks, this rank's first sample of the batch is its ``start``-th."""

    total: int | None
    world: int
    start: int


class Loading:
    """The batch the script's loop holds now (set by the sharded loaders while they are iterated)."""

    def __init__(self) -> None:
        self.place: BatchPlace | None = None
        self.loaders: list[EpochLoader] = []  # every loader made (a checkpoint's load sets their epoch)


class EpochLoader:
    """A loader whose sampler moves to the next epoch at each pass (``set_epoch``), as DDP scripts do by hand,
    and that tells `Loading` where each batch it yields sits."""

    def __init__(self, loader: torch.utils.data.DataLoader, loading: Loading) -> None:
        self.loader, self.loading, self.epoch = loader, loading, 0

    def __iter__(self) -> Iterator[Any]:
        sampler = self.loader.sampler
        sampler.set_epoch(self.epoch)
        self.epoch += 1
        total = None if sampler.drop_last else len(sampler.dataset)
        size = self.loader.batch_size
        for i, batch in enumerate(self.loader):
            self.loading.place = BatchPlace(total, sampler.num_replicas, i * size)
            yield batch
        self.loading.place = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def sharded(loader: Any, shard: Any, seed: int, loading: Loading) -> EpochLoader:
    """``loader`` re-made to read shard ``shard.index`` of ``shard.count``."""
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(loader, DataLoader):
        raise OwnLoopError(f"setup_dataloaders: expected torch DataLoaders, got {type(loader).__name__}")
    if loader.batch_size is None:
        raise OwnLoopError("setup_dataloaders: a loader with a batch_sampler of its own cannot be sharded; "
                           "give it batch_size and shuffle")
    sampler = DistributedSampler(loader.dataset, num_replicas=shard.count, rank=shard.index,
                                 shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
                                 drop_last=loader.drop_last)
    made = EpochLoader(DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                                  num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                  pin_memory=loader.pin_memory, drop_last=loader.drop_last), loading)
    loading.loaders.append(made)
    return made


def kept_rows(place: BatchPlace | None, counts: list[int]) -> list[tuple[int, int]]:
    """(shard, row) of every row to keep, in the order's places, given each data shard's rows in this batch (a
    shard is a rank's on data-parallel backends). Without a place (a gather outside a sharded loader's loop):
    every row, shard by shard."""
    if place is None:
        return [(rank, row) for rank, count in enumerate(counts) for row in range(count)]
    return [(rank, row) for row in range(max(counts, default=0)) for rank in range(place.world)
            if row < counts[rank] and (place.total is None or rank + (place.start + row) * place.world < place.total)]


def gather(data: Any, backend: Any, world: Any, place: BatchPlace | None) -> Any:
    """`Distributed.gather_for_metrics`: every tensor of ``data`` gathered over the data shards through the
    backend's all-reduce (the rank that reports for each shard fills that shard's slot of a zeroed buffer: the
    ranks of a tensor group hold the same rows, taken once), the copies dropped (`kept_rows`)."""
    if world.size == 1:
        return data
    if torch.is_tensor(data):
        return _gather_one(data, backend, place, backend.data_shard)
    if type(data) in (tuple, list):
        return type(data)(gather(item, backend, world, place) for item in data)
    if type(data) is dict:
        return {key: gather(value, backend, world, place) for key, value in data.items()}
    raise OwnLoopError(f"gather_for_metrics: expected a tensor, or a tuple, list or dict of tensors; got "
                       f"{type(data).__name__}")


def _gather_one(tensor: torch.Tensor, backend: Any, place: BatchPlace | None, shard: Any) -> torch.Tensor:
    local = tensor.detach().reshape(tensor.shape[0] if tensor.ndim else 1, -1).double().cpu().numpy()
    counts = np.zeros(shard.count)
    if shard.reports:
        counts[shard.index] = local.shape[0]
    counts = np.asarray(backend.all_reduce(counts, "sum")).astype(int).tolist()
    buffer = np.zeros((shard.count, max(counts), local.shape[1]))
    if shard.reports:
        buffer[shard.index, :local.shape[0]] = local
    buffer = np.asarray(backend.all_reduce(buffer, "sum"))
    rows = kept_rows(place, counts)
    picked = np.stack([buffer[r, i] for r, i in rows]) if rows else np.zeros((0, local.shape[1]))
    shape = (len(rows), *tensor.shape[1:]) if tensor.ndim else (len(rows),)
    return torch.as_tensor(picked.reshape(shape)).to(tensor.device, tensor.dtype)

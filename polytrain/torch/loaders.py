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
    """Where the current batch of a sharded loader sits in its pass over the data: this rank's rows are places
    ``base + rank + j·world`` (j = 0, 1, ...) of the pass's order, and places from ``total`` on are the copies that
    even out the ranks' shares (None: there are none, the sampler drops the tail). ``weight``: what `backward`
    multiplies this rank's loss by so that the ranks' average is the mean over the step's samples — 1 unless the
    ranks' shares of a step differ (a pass at a world size the global batch does not divide, after an elastic
    recovery): then ``rows · world / step samples`` (0 for a rank holding only a copy). ``size``: the step's
    samples when the world does not divide the global batch (a rank's places from it on are copies); else None."""

    total: int | None
    world: int
    base: int
    weight: float = 1.0
    size: int | None = None

    def keeps(self, rank: int, row: int) -> bool:
        """Whether ``rank``'s ``row`` of this batch is a sample (not a copy)."""
        place = rank + row * self.world
        return (self.total is None or self.base + place < self.total) and (self.size is None or place < self.size)


class Loading:
    """The batch the script's loop holds now (set by the sharded loaders while they are iterated)."""

    def __init__(self) -> None:
        self.place: BatchPlace | None = None
        self.loaders: list[EpochLoader] = []  # every loader made (a checkpoint's load sets their epoch)


def rest_plan(n: int, global_batch: int, world: int, rank: int,
              drop_last: bool) -> list[tuple[list[int], int, float, int]]:
    """This rank's batches over ``n`` samples still to use in a pass, each step taking the next ``global_batch``
    of them, rank r every world-th from the step's r-th. When ``world`` divides the global batch the places run
    past ``n`` as `DistributedSampler` pads (copies, so every share is equal, weight 1); else the shares differ by one and each rank's loss is weighted by its share
    (a rank left without a sample in a short last step holds one copy, weighted 0). ``drop_last``: a short last
    step is dropped. Per batch: (places, the step's first place, weight, the step's length)."""
    even = global_batch % world == 0
    padded = -(-n // world) * world if even and not drop_last else n
    batches = []
    for base in range(0, padded, global_batch):
        length = min(global_batch, padded - base)
        if drop_last and length < global_batch:
            break
        mine = list(range(base + rank, base + length, world))
        count = len(mine)
        batches.append((mine or [base], base, count * world / length, length))
    return batches


class EpochLoader:
    """A loader whose sampler moves to the next epoch at each pass (``set_epoch``), as DDP scripts do by hand,
    and that tells `Loading` where each batch it yields sits.

    It keeps the job's global batch (the first shard count × the loader's batch size) and knows where a pass
    stands (`position`: its epoch and how many samples of its order the batches yielded so far cover), so that an
    elastic recovery can re-shard it for a new world (`reshard`) and go on with the rest of a pass exactly
    (`go_on`): every sample of the epoch once, each step still ``global_batch`` samples. A pass that starts at an
    epoch's beginning on a world size dividing the global batch is the `DistributedSampler` pass it always was."""

    def __init__(self, source: Any, shard: Any, seed: int, loading: Loading) -> None:
        from torch.utils.data import RandomSampler

        self.source, self.seed, self.loading = source, seed, loading
        self.shuffle = isinstance(source.sampler, RandomSampler)
        self.global_batch = source.batch_size * shard.count
        self.epoch = 0
        self.open: tuple[int, int] | None = None  # (epoch, samples covered) of the pass under way
        self._pending: tuple[int, int] | None = None  # the pass the next iteration goes on with
        self.reshard(shard)

    def reshard(self, shard: Any) -> None:
        """Read shard ``shard.index`` of ``shard.count`` from here on, at the same global batch."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        source = self.source
        self.shard = shard
        per = self.global_batch // shard.count if self.global_batch % shard.count == 0 else source.batch_size
        sampler = DistributedSampler(source.dataset, num_replicas=shard.count, rank=shard.index,
                                     shuffle=self.shuffle, seed=self.seed, drop_last=source.drop_last)
        self.loader = DataLoader(source.dataset, batch_size=per, sampler=sampler, drop_last=source.drop_last,
                                 **self._loading_options())

    def _loading_options(self) -> dict[str, Any]:
        source = self.source
        return {"num_workers": source.num_workers, "collate_fn": source.collate_fn, "pin_memory": source.pin_memory}

    def position(self) -> tuple[int, int]:
        """(epoch, samples of its order covered): where the next batch of this loader comes from."""
        return self.open or self._pending or (self.epoch, 0)

    def go_on(self, epoch: int, covered: int) -> None:
        """The next iteration is epoch ``epoch`` from its ``covered``-th sample (a `position`)."""
        self.epoch, self.open = epoch, None
        self._pending = (epoch, covered) if covered else None

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._pending or (self.epoch, 0)
        self._pending, self.epoch = None, epoch + 1
        try:
            passes = self._standard(epoch) if self._sampled(start) else self._rest(epoch, start)
            for batch, place, covered in passes:
                self.open, self.loading.place = (epoch, covered), place
                yield batch
        finally:  # ended, or left (a break, an error): the next pass is the next epoch's
            self.open = self.loading.place = None

    def _sampled(self, start: int) -> bool:
        """Whether a pass from sample ``start`` is the `DistributedSampler` pass (`loader`): from an epoch's start, on
        a world that divides the global batch."""
        return start == 0 and self.global_batch % self.shard.count == 0

    def _standard(self, epoch: int) -> Iterator[tuple[Any, BatchPlace, int]]:
        sampler = self.loader.sampler
        sampler.set_epoch(epoch)
        n = len(sampler.dataset)
        total = None if sampler.drop_last else n
        step = self.loader.batch_size * sampler.num_replicas
        for i, batch in enumerate(self.loader):
            yield batch, BatchPlace(total, sampler.num_replicas, i * step), min((i + 1) * step, n)

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the whole set, as every rank's `DistributedSampler` draws it."""
        from torch.utils.data.distributed import DistributedSampler

        whole = DistributedSampler(self.source.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        whole.set_epoch(epoch)
        return list(whole)

    def _rest(self, epoch: int, start: int) -> Iterator[tuple[Any, BatchPlace, int]]:
        from torch.utils.data import DataLoader

        rest = self._order(epoch)[start:]
        if not rest:
            return
        n, world = len(rest), self.shard.count
        plan = rest_plan(n, self.global_batch, world, self.shard.index, self.source.drop_last)
        batches = [[rest[p % n] for p in places] for places, _, _, _ in plan]
        loader = DataLoader(self.source.dataset, batch_sampler=batches, **self._loading_options())
        uneven = self.global_batch % world != 0
        for batch, (_, base, weight, length) in zip(loader, plan):
            place = BatchPlace(n, world, base, weight, length if uneven else None)
            yield batch, place, start + min(base + self.global_batch, n)

    def __len__(self) -> int:
        start = (self._pending or (self.epoch, 0))[1]
        if self._sampled(start):
            return len(self.loader)
        n = len(self.source.dataset) - start
        return len(rest_plan(max(n, 0), self.global_batch, self.shard.count, self.shard.index, self.source.drop_last))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def sharded(loader: Any, shard: Any, seed: int, loading: Loading) -> EpochLoader:
    """``loader`` re-made to read shard ``shard.index`` of ``shard.count``."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise OwnLoopError(f"setup_dataloaders: expected torch DataLoaders, got {type(loader).__name__}")
    if loader.batch_size is None:
        raise OwnLoopError("setup_dataloaders: a loader with a batch_sampler of its own cannot be sharded; "
                           "give it batch_size and shuffle")
    made = EpochLoader(loader, shard, seed, loading)
    loading.loaders.append(made)
    return made


def kept_rows(place: BatchPlace | None, counts: list[int]) -> list[tuple[int, int]]:
    """(shard, row) of every row to keep, in the order's places, given each data shard's rows in this batch (a
    shard is a rank's on data-parallel backends). Without a place (a gather outside a sharded loader's loop):
    every row, shard by shard."""
    if place is None:
        return [(rank, row) for rank, count in enumerate(counts) for row in range(count)]
    return [(rank, row) for row in range(max(counts, default=0)) for rank in range(place.world)
            if row < counts[rank] and place.keeps(rank, row)]


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

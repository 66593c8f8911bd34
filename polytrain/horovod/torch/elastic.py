"""``hvd.elastic``: ``run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``.

Same commit/restore semantics as Horovod's: ``state.commit()`` saves a copy that a
failed collective (HorovodInternalError) rolls back to before the function is re-run on a
re-initialised group. The shim also survives restarts of the whole job driven by
``torchrun --max-restarts``: rank 0 writes every commit to
``$POLYTRAIN_HOROVOD_ELASTIC_DIR/state.safetensors`` (default ``<tmp>/polytrain-elastic-<uid>-<job key>``,
the key made from torchrun's run id and master port), and a restarted job's ``run``
restores from it before syncing every rank from rank 0. A first start ignores the file.
The file holds tensors and JSON, never pickle, in a directory private to the user, in the one
format both frameworks write (`polytrain.horovod.common.elastic_files`; `TorchTensors` is how torch
tensors are stored in it): committed plain values must be numbers, strings, None, tensors, numpy
arrays, or lists/tuples/dicts of them.
Under polytrain's elastic driver (``polytrain launch --launcher horovodrun --min-np ...`` without real Horovod)
the group is re-formed in the same processes instead (`elastic_world`): survivors keep training, new hosts
join at a commit (HostsUpdatedInterrupt), and no commit file is written (nothing would read it). This is the
shim's module: with real Horovod, ``hvd.elastic`` is
``horovod.torch.elastic``.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from polytrain.horovod.common import HorovodInternalError, elastic_files
from polytrain.horovod.common.elastic_files import STATE_DIR_VARIABLE, state_dir
from polytrain.horovod.common.elastic_state import ObjectStateBase, retrying
from polytrain.horovod.common.ops import Sum
from polytrain.horovod.torch import basics, elastic_world
from polytrain.horovod.torch.collectives import barrier
from polytrain.horovod.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from polytrain.horovod.torch.ops import allreduce


class TorchTensors(elastic_files.Tensors):
    """A commit's tensors as torch tensors: a snapshot's own tensors come back on their device, numpy values as
    numpy (stored as tensors of their dtype)."""

    kinds = "tensors, numpy arrays"

    def own(self, value: Any, where: str) -> tuple[torch.Tensor, dict[str, Any]] | None:
        if not isinstance(value, torch.Tensor):
            return None
        if value.layout != torch.strided:
            raise TypeError(f"hvd.elastic: cannot persist {where}: a {value.layout} tensor (only dense tensors)")
        return value.detach().to("cpu").contiguous().clone(), {"device": str(value.device)}

    def from_numpy(self, array: np.ndarray, where: str) -> torch.Tensor:
        try:
            return torch.from_numpy(array)
        except TypeError:  # object, string and other dtypes torch has no tensor for
            raise TypeError(f"hvd.elastic: cannot persist {where}: a numpy {array.dtype} value has no tensor "
                            f"dtype") from None

    def to_numpy(self, stored: torch.Tensor) -> np.ndarray:
        return stored.numpy()

    def tensor(self, stored: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
        return stored if entry["device"] == "cpu" else stored.to(entry["device"])

    def save(self, stored: dict[str, Any], metadata: dict[str, str]) -> bytes:
        return safetensors.torch.save(stored, metadata=metadata)

    def load(self, data: bytes) -> dict[str, Any]:
        return safetensors.torch.load(data)


TORCH = TorchTensors()


def write_state(directory: Path, snapshot: Any) -> Path:
    """Save ``snapshot`` atomically as ``directory/state.safetensors``; the directory is made private."""
    return elastic_files.write_state(directory, snapshot, TORCH)


def read_state(directory: Path) -> Any | None:
    """The snapshot saved in ``directory`` (checked private first), or None if there is none."""
    return elastic_files.read_state(directory, TORCH)


class ObjectState(ObjectStateBase):
    """Plain Python attributes kept in step across ranks and restored on failure."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = basics.rank, **kwargs: Any):
        super().__init__(bcast_object, get_rank, **kwargs)

    def _barrier(self) -> None:
        barrier()

    def _sum(self, value: float) -> float:
        return float(allreduce(torch.tensor([value], dtype=torch.float64), op=Sum, name="elastic.preempted")[0])

    def _size(self) -> int:
        return basics.size()

    def _host_change(self) -> int | None:
        if not elastic_world.active():
            return None
        return elastic_world.hosts_change() if self._rank() == 0 else 0

    def _read_state(self, directory: Path) -> Any | None:
        return read_state(directory)

    def commit(self) -> None:
        """Save the current values as the point to roll back (and restart) to.

        Ends with a collective, as Horovod's does: no rank leaves a commit before rank 0
        has written it, so a job restarted after any rank's failure resumes from it.
        """
        self.save()
        self.persist()
        self.check_host_updates()

    def persist(self) -> None:
        # under polytrain's elastic driver nothing reads the file: a re-form keeps the commit in memory, and a job the
        # driver ended starts afresh (a first start ignores the file); writing it cost ~10 ms per commit on the bench
        if self._rank() == 0 and not elastic_world.active():
            write_state(state_dir(), self.snapshot())


class TorchState(ObjectState):
    """Model, optimizer, ElasticSampler and plain values of a PyTorch training process."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handled = {k: v for k, v in kwargs.items() if _handles(v)}
        object.__setattr__(self, "_handled", handled)
        object.__setattr__(self, "_saved_handled", {k: copy.deepcopy(v.state_dict()) for k, v in handled.items()})
        for name, value in handled.items():
            object.__setattr__(self, name, value)
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank,
                         **{k: v for k, v in kwargs.items() if k not in handled})

    def __setattr__(self, name: str, value: Any) -> None:
        handled = self.__dict__.get("_handled", {})
        if name in handled:
            handled[name] = value
            self._saved_handled[name] = copy.deepcopy(value.state_dict())
        super().__setattr__(name, value)

    def save(self) -> None:
        self._saved_handled = {k: copy.deepcopy(v.state_dict()) for k, v in self._handled.items()}
        super().save()

    def restore(self) -> None:
        for name, value in self._handled.items():
            value.load_state_dict(self._saved_handled[name])
        super().restore()

    def sync(self) -> None:
        for value in self._handled.values():
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=0)
            else:
                value.load_state_dict(broadcast_object(value.state_dict()))
        super().sync()

    def reset(self) -> None:
        """After a re-form: each ElasticSampler partitions what is left of its epoch at the new size (the sync that
        would do it is skipped when hosts were only removed)."""
        for value in self._handled.values():
            if isinstance(value, ElasticSampler):
                value.reset()
        super().reset()

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "handled": self._saved_handled}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        super().load_snapshot(snapshot)
        self._saved_handled = snapshot["handled"]
        for name, value in self._handled.items():
            value.load_state_dict(self._saved_handled[name])


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across ranks; remembers how far an epoch got (``record_batch``)."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (call at the end of an epoch: it forgets processed samples)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        self.num_replicas = basics.size()
        self.rank = basics.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Any:
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def _handles(value: Any) -> bool:
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, ElasticSampler))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)``, rolling back to the last commit and retrying on HorovodInternalError (under
    polytrain's elastic driver, also on a lost peer's gloo error) and going on after a HostsUpdatedInterrupt,
    each time on a group re-formed in the same process."""
    return retrying(func, begin=lambda state: state.load_persisted(), failed=_failed, restart=_restart)


def _failed(error: BaseException) -> bool:
    if isinstance(error, HorovodInternalError):
        return True
    from polytrain.adapters.torch.reform import is_peer_loss

    return elastic_world.active() and is_peer_loss(error)


def _restart() -> None:
    """Horovod shut down and started again; under the elastic driver on its next membership version, with every
    DistributedOptimizer set up again for the new group (its collectives in flight dropped first)."""
    for optimizer in list(elastic_world.LIVE):
        optimizer._reset_step()
    basics.shutdown()
    if elastic_world.active():
        elastic_world.next_round()
    basics.init()
    for optimizer in list(elastic_world.LIVE):
        optimizer._seq = 0
        optimizer._build()


__all__ = ["STATE_DIR_VARIABLE", "ElasticSampler", "ObjectState", "TorchState", "TorchTensors", "read_state", "run",
           "state_dir", "write_state"]

"""Broadcasting model and optimizer state, and Python objects (Horovod's ``functions.py`` API).

``broadcast_object``/``allgather_object`` unpickle what the other ranks of this job sent (Horovod's
contract: any picklable object); the bytes never come from a file. tests/test_no_unpickle.py lists them.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from polytrain.horovod.torch.collectives import broadcast_async_, synchronize
from polytrain.horovod.torch.ops import allgather, broadcast_
from polytrain.horovod.torch.process_sets import ProcessSet, global_process_set
from polytrain.horovod.torch.runtime import rank


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle  # what Horovod uses: also pickles lambdas and local classes
    except ImportError:
        return pickle.dumps(obj)
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return buffer.getvalue()


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite parameters/buffers with ``root_rank``'s, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` (as a list) or a list of tensors.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name) for name, p in items]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    State an optimizer creates lazily (Adam's moments) is created first with one zero-gradient
    step, as Horovod does, so that every rank has tensors to receive into.
    """
    from polytrain.horovod.torch.optimizer import DistributedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = inner.state_dict()
    if len(state_dict["state"]) == 0:
        # every gradient zero for that step, as Horovod's: a gradient left from the last backward (a sync after a
        # step, as hvd.elastic's) would otherwise be applied a second time; each is put back after
        kept = {}
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    kept[p] = p.grad
                    p.grad = torch.zeros_like(p)
                    if isinstance(inner, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
        inner.step()
        for p, grad in kept.items():
            p.grad = grad
        state_dict = inner.state_dict()
    if len(state_dict["state"]) == 0:
        return

    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    setters: dict[str, Any] = {}
    occurrences: dict[str, int] = collections.defaultdict(int)
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                setters[f"{key}.{index}"] = _group_setter(inner, index, key)
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    setters[key] = _state_setter(state_dict, pid, name)
    broadcast_parameters(tensors, root_rank)
    # state_dict() holds the live per-parameter state: tensors were updated in place, and
    # scalars are written back into the same dicts.
    for key, value in broadcast_object(scalars, root_rank).items():
        setters[key](value)


def _group_setter(optimizer: torch.optim.Optimizer, index: int, key: str) -> Any:
    def assign(value: Any) -> None:
        optimizer.param_groups[index][key] = value
    return assign


def _state_setter(state_dict: dict[str, Any], pid: int, name: str) -> Any:
    def assign(value: Any) -> None:
        state_dict["state"][pid][name] = value
    return assign


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``obj`` as held by ``root_rank``, pickled and broadcast."""
    name = name or type(obj).__name__
    if rank() == root_rank:
        payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        broadcast_(length, root_rank, name + ".sz", process_set)
    else:
        length = torch.zeros(1, dtype=torch.int64)
        broadcast_(length, root_rank, name + ".sz", process_set)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name + ".t", process_set)
    if rank() == root_rank:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    name = name or type(obj).__name__
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=name + ".sz",
                      process_set=process_set).tolist()
    gathered = allgather(payload, name=name + ".t", process_set=process_set).numpy().tobytes()
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pickle.loads(gathered[o:o + s]) for o, s in zip(offsets, sizes)]


__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]

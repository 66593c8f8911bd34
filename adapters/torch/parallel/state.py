"""Gradients and state across a model-parallel layout: the data-parallel gradient average, the global
gradient norm, and the portable (full-tensor) form of model and optimizer state.

A rank holds DTensors (tensor-parallel shards, FSDP shards) and plain tensors (replicated parts) of its
pipeline stage(s) only. The portable form is what one process would hold: every tensor whole, every stage's
parameters, the transformer's qkv rows in their portable order — on every rank, so any layout can resume it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_gradients(params: Iterable[nn.Parameter], group: Any, size: int) -> int:
    """Average this rank's gradient shards over the data-parallel ``group`` in one flat all-reduce (the
    ranks of a group hold the same shards). Returns the bytes reduced."""
    params = list(params)
    grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for param, grad in zip(params, grads):
        _set_grad(param, flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return flat.numel() * flat.element_size()


def tied_group(mesh: Any, pp_group: Any | None) -> Any:
    """The group of the first and the last pipeline rank of this rank's ``pp`` line (the pp group itself at
    P = 2); None on the ranks between. Collective: every rank makes every line's group, in one order."""
    pipeline = mesh.size(0)
    if pipeline == 2:
        return pp_group
    mine = None
    for line in mesh.mesh.reshape(pipeline, -1).T.tolist():
        group = dist.new_group([line[0], line[-1]])
        if dist.get_rank() in (line[0], line[-1]):
            mine = group
    return mine


def sum_tied_gradients(params: list[nn.Parameter], group: Any | None) -> int:
    """Add up the gradients of each tied weight's two copies (first and last stage), so that each holds the
    gradient the one shared weight of the whole model gets: in one flat all-reduce over ``group`` where the copies
    are on two ranks (``params`` in one order on both), or here where ``params`` pairs them (copy, first-stage
    weight, ...) and ``group`` is None. DTensor shards as they are. Returns the bytes reduced."""
    for param in params:  # an embedding's gradient may come out of tensor parallel replicated: shard it as its weight
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
    grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
    if group is None:
        sums = [a + b for a, b in zip(grads[::2], grads[1::2])]
        for param, value in zip(params, [s for s in sums for _ in (0, 1)]):
            _set_grad(param, value)
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for param, grad in zip(params, grads):
        _set_grad(param, flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return flat.numel() * flat.element_size()


def _set_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = DTensor.from_local(value.clone(), param.device_mesh, param.placements) \
            if isinstance(param, DTensor) else value.clone()
    else:
        local(param.grad).copy_(value)


def global_grad_norm(params: Iterable[nn.Parameter], pp_group: Any | None,
                     copies: Container[int] = ()) -> torch.Tensor:
    """The 2-norm of the whole model's gradient: DTensor shards summed over their meshes, each replicated
    tensor counted once, the pipeline stages summed over ``pp_group``; a tied weight's second copy (ids in
    ``copies``) is not counted again."""
    total = torch.zeros((), dtype=torch.float64)
    for param in params:
        grad = param.grad
        if grad is None or id(param) in copies:
            continue
        norm = torch.linalg.vector_norm(grad.float())
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.double().cpu() ** 2
    if pp_group is not None:
        device_total = total.to(_group_device(pp_group))
        dist.all_reduce(device_total, group=pp_group)
        total = device_total.cpu()
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, pp_group: Any | None,
                   copies: Container[int] = ()) -> float:
    norm = float(global_grad_norm(params, pp_group, copies))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                local(param.grad).mul_(coef)
    return norm


def _group_device(group: Any) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def full_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every value whole (DTensors gathered) on the CPU."""
    out = {}
    for key, value in state.items():
        tensor = torch.as_tensor(value)
        out[key] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    return out


def gather_stages(mine: dict[str, torch.Tensor], pp_group: Any | None, order: list[str]) -> dict[str, torch.Tensor]:
    """Every stage's tensors on every rank of the pipeline, in the whole model's key order (``order``,
    then any other keys as they come)."""
    if pp_group is None:
        merged = mine
    else:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, {k: v.numpy() for k, v in mine.items()}, group=pp_group)
        merged = {k: torch.from_numpy(v) for part in parts for k, v in part.items()}
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(merged.items(), key=lambda item: (rank.get(item[0].split("/", 1)[0], len(rank)), item[0])))

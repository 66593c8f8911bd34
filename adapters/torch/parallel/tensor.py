"""Tensor parallelism: a model's layers split across the ranks of the ``tp`` mesh dimension with DTensor's
``parallelize_module`` (Megatron-LM's column/row split), from a plan.

The zoo transformer's plan: in each block, ``attn.qkv`` and ``mlp.fc`` column-wise (each rank computes
its heads / its share of the MLP width), ``attn.proj`` and ``mlp.out`` row-wise (one all-reduce per
sub-layer brings the sum back); the token embedding is split by vocabulary rows (an all-reduce after the
lookup) and the head by vocabulary columns (its logits all-gathered, so the loss sees the whole vocabulary).
A tied head keeps sharing the embedding's (sharded) matrix. LayerNorms and the position embedding stay whole
on every rank, their gradients equal across the group.

``attn.qkv`` is one fused projection whose portable row order is [all q; all k; all v]; a contiguous
column split of that would give rank 0 the queries of every head. The plan first reorders its rows head by
head (``head_major``) so each rank's slice holds whole heads; checkpoints and exported state are turned back
into the portable order (`to_portable` / `from_portable`), so nothing outside this module sees the change.

A user model gives ``parallel.tensor_plan: package.module:function``, called as ``function(model, tp_mesh)``
and returning the ``{submodule name: ParallelStyle}`` plan for ``parallelize_module``; the own-loop API may
pass such a function itself (``plan_function``; the spec then names it ``fit:<name>``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from polytrain.errors import SpecError
from polytrain.spec.layout import no_tensor_plan
from polytrain.spec.tables import TrainSpec


def to_head_major(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """qkv rows [q; k; v] (each head by head) → [q0 k0 v0; q1 k1 v1; ...]; a bias (1-D) likewise."""
    rest = tensor.shape[1:]
    return tensor.reshape(3, n_heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def from_head_major(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `to_head_major`: back to the portable [q; k; v] row order."""
    rest = tensor.shape[1:]
    return tensor.reshape(n_heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def to_portable(state: Mapping[str, torch.Tensor], head_major: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Full tensors in the portable layout (a state or optimizer-state key starts with a parameter name)."""
    return {key: _reorder(key, value, head_major, from_head_major) for key, value in state.items()}


def from_portable(state: Mapping[str, torch.Tensor], head_major: Mapping[str, int]) -> dict[str, torch.Tensor]:
    return {key: _reorder(key, value, head_major, to_head_major) for key, value in state.items()}


def _reorder(key: str, value: torch.Tensor, head_major: Mapping[str, int], how: Any) -> torch.Tensor:
    name = key.split("/", 1)[0]
    if name in head_major and value.ndim >= 1:
        return how(value, head_major[name])
    return value


def _transformer_plan(model: nn.Module, degree: int) -> tuple[dict[str, Any], dict[str, int]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    head_major: dict[str, int] = {}
    for i, block in enumerate(model.blocks):
        attn, width = block.attn, block.mlp.fc.out_features
        if attn.n_heads % degree:
            raise SpecError(f"parallel.tensor: {degree} does not divide the transformer's {attn.n_heads} attention "
                            f"heads (model.params.n_heads); choose a divisor of it")
        if width % degree:
            raise SpecError(f"parallel.tensor: {degree} does not divide the MLP width {width} (model.params.d_ff)")
        with torch.no_grad():
            for param in (attn.qkv.weight, attn.qkv.bias):
                param.copy_(to_head_major(param, attn.n_heads))
        attn.head_major = True
        head_major[f"blocks.{i}.attn.qkv.weight"] = head_major[f"blocks.{i}.attn.qkv.bias"] = attn.n_heads
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.out": RowwiseParallel()})
    plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan, head_major


def _user_plan(target: str, model: nn.Module, mesh: Any, function: Callable[..., Any] | None) -> dict[str, Any]:
    from polytrain.spec.user_code import load_callable

    plan = (function or load_callable(target, "parallel.tensor_plan"))(model, mesh)
    if not isinstance(plan, Mapping):
        raise SpecError(f"parallel.tensor_plan: {target} returned {type(plan).__name__}, expected a dict of "
                        "{submodule name: ParallelStyle}")
    return dict(plan)


def apply_tensor_parallel(spec: TrainSpec, model: nn.Module, mesh: Any,
                          plan_function: Callable[..., Any] | None = None) -> dict[str, int]:
    """Split ``model`` in place over the 1-D ``mesh`` (the tp dimension), by the spec's ``tensor_plan`` (or
    ``plan_function``, a live one named by it), else the zoo transformer's own plan. Returns the parameters
    kept in the head-major order (name → heads), for `to_portable`."""
    from torch.distributed.tensor.parallel import parallelize_module

    from polytrain.adapters.torch.transformer import TransformerLM

    degree = spec.parallel.tensor
    if spec.parallel.tensor_plan is not None:
        plan, head_major = _user_plan(spec.parallel.tensor_plan, model, mesh, plan_function), {}
    elif isinstance(model, TransformerLM):
        plan, head_major = _transformer_plan(model, degree)
    else:
        raise no_tensor_plan(type(model).__name__)
    names = dict(model.named_modules())
    missing = [name for name in plan if name not in names]
    if missing:
        raise SpecError(f"parallel.tensor_plan: no submodule {missing[0]!r} in {type(model).__name__} (the plan names "
                        f"{len(missing)} missing module(s)); use names from model.named_modules()")
    tied = _tied_pairs(model)
    try:
        parallelize_module(model, mesh, plan)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        text = " ".join(str(exc).split())[:200]
        raise SpecError(f"parallel.tensor: the plan cannot split {type(model).__name__}: {text}") from None
    for owner, attr, source in tied:  # parallelize_module made a copy for each use: share one again
        setattr(owner, attr, source())
    return head_major


def _tied_pairs(model: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """Parameters registered under more than one name: (module, attribute, how to get the first one)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    tied = []
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in first:
                owner, owner_attr = first[id(param)]
                tied.append((module, attr, lambda o=owner, a=owner_attr: getattr(o, a)))
            else:
                first[id(param)] = (module, attr)
    return tied

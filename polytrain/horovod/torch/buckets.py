"""Gradient buckets for DistributedOptimizer: fixed groups of parameters reduced as one buffer.

Parameters are taken in reverse registration order (gradients of the last layers are
ready first), split by dtype and device, and packed into buckets of at most
``cap_bytes`` (a first, smaller bucket starts communication early). Every rank builds the
same layout from the same model, and buckets are launched in index order, so the
collectives line up across ranks without any per-step negotiation.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class Bucket:
    index: int
    params: list[torch.Tensor]
    names: list[str]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    ready: int = 0
    buffer: torch.Tensor | None = None
    #: (work, sent tensor, compression ctx) once launched
    launched: tuple[Any, torch.Tensor, Any] | None = None
    slots: dict[int, int] = field(default_factory=dict)
    launched_at: float = 0.0  # timeline clock, when the allreduce started

    def label(self) -> str:
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        return f"{self.names[0]}{more}"


def plan_buckets(params: Sequence[torch.Tensor], names: Sequence[str], cap_bytes: int,
                 groups: Sequence[Sequence[int]] | None = None) -> list[Bucket]:
    """Pack parameters (indices into ``params``) into buckets.

    ``groups`` (Horovod's ``groups=`` argument, as lists of indices) fixes the buckets
    instead: each group is one bucket, split only where dtypes or devices differ.
    """
    if groups is None:
        order = list(reversed(range(len(params))))
        chunks: list[list[int]] = []
        sizes: list[int] = []
        open_by_kind: dict[tuple[torch.dtype, torch.device], int] = {}
        for i in order:
            p = params[i]
            kind = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            current = open_by_kind.get(kind)
            limit = min(cap_bytes, FIRST_BUCKET_BYTES) if current == 0 else cap_bytes
            if current is None or (sizes[current] > 0 and sizes[current] + nbytes > limit):
                chunks.append([])
                sizes.append(0)
                current = open_by_kind[kind] = len(chunks) - 1
            chunks[current].append(i)
            sizes[current] += nbytes
    else:
        chunks = []
        for group in groups:
            by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
            for i in group:
                by_kind.setdefault((params[i].dtype, params[i].device), []).append(i)
            chunks.extend(by_kind.values())
    buckets = []
    for index, chunk in enumerate(chunks):
        offsets, total = [], 0
        for i in chunk:
            offsets.append(total)
            total += params[i].numel()
        first = params[chunk[0]]
        bucket = Bucket(index=index, params=[params[i] for i in chunk], names=[names[i] for i in chunk],
                        offsets=offsets, numel=total, dtype=first.dtype, device=first.device)
        bucket.slots = {id(p): k for k, p in enumerate(bucket.params)}
        buckets.append(bucket)
    return buckets


def layout_id(buckets: Sequence[Bucket]) -> int:
    """A fingerprint of names, shapes, dtypes and bucket boundaries (equal on every rank or a bug)."""
    text = "|".join(f"{b.dtype}:" + ",".join(f"{n}{tuple(p.shape)}" for n, p in zip(b.names, b.params))
                    for b in buckets)
    return zlib.crc32(text.encode())


def split_groups(params: Sequence[torch.Tensor], groups: Any) -> list[list[int]] | None:
    """Horovod's ``groups=``: a number of equal groups, or lists of tensors (the rest one each)."""
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups <= 0:
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        count = min(groups, len(params))
        base, extra = divmod(len(params), count)
        out, start = [], 0
        for g in range(count):
            end = start + base + (1 if g < extra else 0)
            out.append(list(range(start, end)))
            start = end
        return out
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out = []
    for group in groups:
        members = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
            if id(p) in index:
                members.append(index[id(p)])
        if members:
            out.append(members)
    out.extend([i] for i, p in enumerate(params) if id(p) not in seen)
    return out


def name_parameters(param_groups: Sequence[dict[str, Any]], named_parameters: Any) -> dict[torch.Tensor, str]:
    """DistributedOptimizer's parameter names (Horovod's ``allreduce.noname.<group>.<index>`` where none are
    given), refusing what Horovod refuses: items that are not pairs, duplicate names, unnamed parameters."""
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    named_ids = {id(p) for _, p in named}
    unnamed = [id(p) for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: " + ", ".join(map(str, unnamed)))
    return {p: n for n, p in named}

"""One traced forward (and backward) of a fake model for `polytrain.plan.census`: what autograd saves for the
backward pass per region (`Recorder`: before the first block, inside block ``i``, after the last), fitted as a
`Linear` function of the batch from traces at 1 and 2 samples, and the bytes of each DTensor collective.

Two precisions of computing are traced. Under the spec's autocast (ddp and the model-parallel layouts) the
parameters stay fp32 and each op casts what it takes, so the low-precision copies of the weights are saved too.
Natively (fsdp's MixedPrecisionPolicy, DeepSpeed's bf16/fp16 engine) the parameters themselves are in the low
dtype and so are the inputs, so nothing is cast on the way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from polytrain.spec.tables import TrainSpec

#: region of a saved tensor: before the first block, inside block i (0..n-1), after the last block
PRE, POST = -1, 1 << 30
TRACE_BATCHES = (1, 2)


@dataclass(frozen=True)
class Linear:
    """``const + per_sample × batch`` bytes."""

    const: float = 0.0
    per_sample: float = 0.0

    def at(self, batch: float) -> float:
        return max(self.const + self.per_sample * batch, 0.0)

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.const + other.const, self.per_sample + other.per_sample)


def fit_line(at1: float, at2: float) -> Linear:
    return Linear(2 * at1 - at2, at2 - at1)


@dataclass(frozen=True)
class Trace:
    """What one forward keeps for the backward pass, per region, as a function of the batch (see the module)."""

    pre: Linear
    post: Linear
    blocks: tuple[Linear, ...]  # saved inside block i
    #: block i's input, unless saved before or after the blocks or as an earlier block's input: what activation
    #: checkpointing keeps of the block
    block_inputs: tuple[Linear, ...]
    block_outputs: tuple[Linear, ...]  # block i's output (a pipeline stage boundary)
    #: DTensor collectives of one forward and backward: kind ("allreduce", "allgather", "reducescatter") → the
    #: region they ran for (PRE, block i, POST; forward and backward alike) → bytes
    collectives: dict[str, dict[int, Linear]] = field(default_factory=dict)
    flops: Linear = Linear()  # of one forward and the loss (torch's FLOP counter; the whole model's at T = 1)

    def collective_bytes(self, kind: str, batch: float, blocks: range, first: bool, last: bool) -> float:
        """Bytes of ``kind`` for the part of the model a pipeline stage holds: ``blocks``, and what comes before
        them (``first``) or after them (``last``)."""
        return sum(line.at(batch) for region, line in self.collectives.get(kind, {}).items()
                   if region in blocks or (first and region == PRE) or (last and region == POST))

    def total(self) -> Linear:
        out = self.pre + self.post
        for block in self.blocks:
            out = out + block
        return out


def local_tensor(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)


def storage_key(t: Any) -> tuple[int, int]:
    storage = local_tensor(t).untyped_storage()
    return storage._cdata, storage.nbytes()


def example_batch(info: Any, batch: int) -> tuple[Any, Any]:
    import torch

    if info.task == "next_token":
        return tuple(torch.zeros((batch, *info.input_shape), dtype=torch.long) for _ in range(2))
    x = torch.zeros((batch, *info.input_shape))
    y = torch.zeros((batch,), dtype=torch.long) if info.task == "classification" else torch.zeros((batch, 1))
    return x, y


class Recorder:
    """Saved-tensor and module hooks of one traced forward (see the module's docstring); with ``backward`` the
    blocks' backward hooks keep `region` true through the backward pass too (block ``i``'s backward, then what lies
    before it), for the collectives counted there."""

    def __init__(self, model: Any, blocks: list[Any], backward: bool = False) -> None:
        self.params = {storage_key(p)[0] for p in model.parameters()}
        self.region = PRE
        self.saved: dict[int, tuple[int, int]] = {}  # storage → (bytes, region)
        self.inputs: list[tuple[int, int]] = []
        self.outputs: list[int] = []
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda m, args, i=i: self._enter(i, args)))
            self.handles.append(block.register_forward_hook(lambda m, args, out, i=i: self._leave(i, out)))
            if backward:
                self.handles.append(block.register_full_backward_pre_hook(lambda m, grads, i=i: self._back(i)))
                self.handles.append(block.register_full_backward_hook(
                    lambda m, grads_in, grads_out, i=i: self._back(i - 1 if i else PRE)))
        self.n_blocks = len(blocks)

    def _enter(self, i: int, args: Any) -> None:
        self.region = i
        self.inputs.append(storage_key(args[0]))

    def _leave(self, i: int, out: Any) -> None:
        self.region = POST if i == self.n_blocks - 1 else i
        self.outputs.append(local_tensor(out).numel() * local_tensor(out).element_size())

    def _back(self, region: int) -> None:
        self.region = region

    def pack(self, t: Any) -> Any:
        key, nbytes = storage_key(t)
        if key not in self.params and key not in self.saved:
            self.saved[key] = (nbytes, self.region)
        return t

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def regions(self) -> dict[str, Any]:
        pre = sum(n for n, r in self.saved.values() if r == PRE)
        post = sum(n for n, r in self.saved.values() if r == POST)
        inside = [sum(n for n, r in self.saved.values() if r == i) for i in range(self.n_blocks)]
        kept = {key for key, (_, r) in self.saved.items() if r in (PRE, POST)}
        inputs = []
        for key, n in self.inputs[:self.n_blocks]:
            inputs.append(0 if key in kept else n)
            kept.add(key)
        outputs = list(self.outputs[:self.n_blocks])
        return {"pre": pre, "post": post, "inside": inside, "inputs": inputs, "outputs": outputs}


COLLECTIVE_KINDS = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather",
                    "reduce_scatter_tensor": "reducescatter", "all_reduce_coalesced": "allreduce",
                    "all_gather_into_tensor_coalesced": "allgather", "reduce_scatter_tensor_coalesced": "reducescatter"}


def collective_counter(recorder: Recorder) -> Any:
    """A dispatch mode adding up the bytes of each functional collective (what DTensor issues), by kind and by the
    recorder's region at the time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, dict[int, int]] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            kind = COLLECTIVE_KINDS.get(func._schema.name.split("::")[-1]) \
                if func.namespace == "_c10d_functional" else None
            if kind is not None:
                # the full tensor: an all-gather's output, a reduction's input
                full = out if kind == "allgather" else args[0]
                tensors = full if isinstance(full, (list, tuple)) else [full]
                regions = self.bytes.setdefault(kind, {})
                regions[recorder.region] = regions.get(recorder.region, 0) + sum(
                    t.numel() * t.element_size() for t in tensors)
            return out

    return Counter()


def _trace_once(spec: TrainSpec, info: Any, model: Any, blocks: list[Any], batch: int,
                backward: bool, native: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from polytrain.adapters.torch.objectives import loss_fn
    from polytrain.adapters.torch.precision import AUTOCAST_DTYPES
    from polytrain.spec import objectives as objectives

    loss = loss_fn(objectives.loss_name(spec.loss, info.task), None)
    x, y = example_batch(info, batch)
    dtype = AUTOCAST_DTYPES.get(spec.precision)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None and not native else contextlib.nullcontext()
    if native and x.is_floating_point():
        x = x.to(dtype)
    from torch.utils.flop_counter import FlopCounterMode

    recorder = Recorder(model, blocks, backward)
    counter = collective_counter(recorder) if backward else FlopCounterMode(display=False)
    try:
        with counter:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                with autocast:
                    out = model(x)
                value = loss(out.float(), y).sum()
            if backward:
                value.backward()
    finally:
        recorder.close()
    found = dict(counter.bytes) if backward else {"flops": counter.get_total_flops()}
    return recorder.regions(), found


def trace_model(spec: TrainSpec, info: Any, model: Any, blocks: list[Any], backward: bool,
                native: bool = False) -> Trace:
    """``model``'s `Trace` for the spec's loss and precision: under the spec's autocast, or, ``native``, computing in
    the dtype the caller cast the model to (floating inputs cast to it, no autocast)."""
    (r1, c1), (r2, c2) = (_trace_once(spec, info, model, blocks, b, backward, native) for b in TRACE_BATCHES)

    def each(key: str) -> tuple[Linear, ...]:
        return tuple(fit_line(a, b) for a, b in zip(r1[key], r2[key]))

    flops = fit_line(c1.pop("flops", 0), c2.pop("flops", 0))
    collectives = {kind: {region: fit_line(c1.get(kind, {}).get(region, 0), c2.get(kind, {}).get(region, 0))
                          for region in set(c1.get(kind, {})) | set(c2.get(kind, {}))}
                   for kind in sorted(set(c1) | set(c2))}
    return Trace(pre=fit_line(r1["pre"], r2["pre"]), post=fit_line(r1["post"], r2["post"]), blocks=each("inside"),
                 block_inputs=each("inputs"), block_outputs=each("outputs"), collectives=collectives, flops=flops)

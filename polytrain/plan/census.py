"""The model census behind `polytrain plan`: the spec's model built without memory, its parameters per block,
and one traced forward (and, under tensor parallel, backward) per tensor-parallel degree.

The model is built the way the Trainer builds it (the zoo, or ``package.module:factory``), under torch's
`FakeTensorMode`: every tensor has a shape, a dtype and a (meta) storage, none has data. The traced forward runs
the model and the spec's loss on fake inputs of 1 and 2 samples (`polytrain.plan.trace`) under the spec's autocast,
and under bf16/fp16 once more with the model cast to that dtype (how fsdp and DeepSpeed compute); saved-tensor hooks
record every storage autograd keeps for the backward pass (parameters excluded), and module hooks say in which
region it was saved: before the first declared block (``block_classes``), inside block ``i``, or after the last
block (head and loss). What a run holds is linear in the batch, so the two traces give a constant and a
per-sample part of each region, and of each block's input and output (what activation checkpointing keeps,
and what a pipeline stage sends).

Tensor parallel degrees ``T > 1`` are traced on the model split by the real plan (the zoo transformer's, or
``parallel.tensor_plan``) over a fake process group of ``T`` ranks (nothing leaves the process): the census
then holds tensor-parallel rank 0's local parameters and activations, and the bytes each DTensor collective of
a forward and backward moves. Nothing here measures a real run; `polytrain.plan.memory` and `comms` turn the
census into predictions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import SpecError
from polytrain.plan.trace import Trace, example_batch, local_tensor, trace_model
from polytrain.spec.tables import TrainSpec


@dataclass(frozen=True)
class Param:
    """One parameter (a tied one once): its name, shape, element size, and the block holding it (None: outside)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    block: int | None
    #: elements of its gradient where that differs from the parameter's (a tensor-parallel gradient whose layout
    #: is not the parameter's, seen in the traced backward)
    grad_numel: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def grad_elements(self) -> int:
        return self.numel if self.grad_numel is None else self.grad_numel


@dataclass(frozen=True)
class Census:
    """The spec's model: parameters in order, the blocks, and a `Trace` per tensor-parallel degree."""

    model: str
    params: tuple[Param, ...]
    n_blocks: int
    embed: frozenset[str]  # names of the parameters of the modules ``embed`` uses (a pipeline's first stage)
    tied: frozenset[str]  # those of them the last stage holds a copy of under pipeline parallel (a tied head)
    buffer_bytes: int
    sample_bytes: tuple[int, int]  # one sample's input and target, as the model gets them
    traces: dict[int, Trace]  # tensor degree → trace (1: the whole model)
    local_params: dict[int, tuple[Param, ...]]  # tensor degree → tensor rank 0's parameters (local shapes)
    tensor_degrees: tuple[int, ...]  # those the model allows (1 always)
    #: the whole model computing natively in the spec's bf16/fp16 (`polytrain.plan.trace`); None in fp32
    native: Trace | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def embed_params(self) -> int:
        return sum(p.numel for p in self.params if p.name in self.embed)

    def block_sizes(self) -> list[int]:
        sizes = [0] * self.n_blocks
        for p in self.params:
            if p.block is not None:
                sizes[p.block] += p.numel
        return sizes


def model_info(spec: TrainSpec) -> Any:
    """The `DatasetInfo` the model is built for (reads the spec's data as the Trainer does)."""
    from polytrain import registry

    return registry.open_data(spec).info


def build_fake(spec: TrainSpec, info: Any) -> Any:
    """The spec's torch model with fake tensors (call under a `FakeTensorMode`)."""
    from polytrain.adapters.torch.models import build_model
    from polytrain.spec.zoo import model_params

    name, params = spec.model.name, spec.model.params
    if name == "transformer":
        from polytrain.adapters.torch.transformer import build_transformer

        return build_transformer(model_params(name, params), info)
    return build_model(name, params, info)


def _blocks(model: Any, spec: TrainSpec) -> list[Any]:
    from polytrain.adapters.torch.execution import block_modules

    outer: list[Any] = []
    inside: set[int] = set()
    for block in block_modules(model, spec.fsdp.units):
        if id(block) not in inside:
            inside.update(id(m) for m in block.modules())
            outer.append(block)
    return outer


def _params(model: Any, blocks: list[Any]) -> tuple[Param, ...]:
    owner = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    out = []
    for name, p in model.named_parameters():
        grad = None if p.grad is None else local_tensor(p.grad).numel()
        shape = tuple(local_tensor(p).shape)
        param = Param(name, shape, p.element_size(), owner.get(id(p)))
        out.append(param if grad in (None, param.numel) else Param(name, shape, p.element_size(), param.block, grad))
    return tuple(out)


def tensor_degrees(spec: TrainSpec, world_size: int) -> tuple[int, ...]:
    """The tensor-parallel degrees above 1 the model allows at ``world_size`` ranks (`polytrain.spec.layout`'s rules)."""
    from polytrain.spec.layout import ParallelSpec, check_model

    found = []
    for t in range(2, world_size + 1):
        if world_size % t:
            continue
        parallel = ParallelSpec(tensor=t, tensor_plan=spec.parallel.tensor_plan)
        try:
            check_model(parallel, spec.model.name, spec.model.params)
        except SpecError:
            continue
        if spec.model.name != "transformer" and parallel.tensor_plan is None:
            continue
        found.append(t)
    return tuple(found)


@contextlib.contextmanager
def _fake_group(size: int) -> Iterator[Any]:
    """A process group of ``size`` ranks that moves nothing (torch's fake backend), this process rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SpecError("plan: a process group already exists in this process; run polytrain plan on its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


def _split_model(spec: TrainSpec, info: Any, degree: int, mesh: Any) -> Any:
    from dataclasses import replace

    from polytrain.adapters.torch.parallel.tensor import apply_tensor_parallel

    model = build_fake(spec, info)
    apply_tensor_parallel(replace(spec, parallel=replace(spec.parallel, tensor=degree)), model, mesh)
    return model


def _embed_names(model: Any, info: Any) -> tuple[frozenset[str], frozenset[str]]:
    if not (callable(getattr(model, "embed", None)) and callable(getattr(model, "finish", None))):
        return frozenset(), frozenset()
    from polytrain.adapters.torch.parallel.pipeline import embed_modules, example_input, tied_weights

    used = embed_modules(model, example := example_input(info))  # the first stage's; tied: the last's copies
    tied = frozenset(tied_weights(model, example).values())
    return frozenset(f"{name}.{p}" for name in used for p, _ in getattr(model, name).named_parameters()), tied


def take_census(spec: TrainSpec, world_size: int, degrees: Sequence[int] | None = None) -> Census:
    """The census of ``spec``'s model for a job of ``world_size`` ranks (see the module's docstring);
    ``degrees``: the tensor degrees to trace (default: every one the model allows at that size)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from polytrain.adapters.torch.precision import AUTOCAST_DTYPES
    from polytrain.spec.zoo import ZOO

    if spec.framework != "torch" and spec.model.name not in ZOO:
        raise SpecError(f"model.name: plan sizes TensorFlow specs through the zoo's PyTorch twin; {spec.model.name!r} "
                        f"is not a zoo model")
    info = model_info(spec)
    degrees = tensor_degrees(spec, world_size) if degrees is None else tuple(degrees)
    try:
        from torch.testing._internal.distributed import fake_pg  # noqa: F401 - torch's fake process group
    except ImportError:  # a torch without it: no tensor-parallel rows
        degrees = ()
    traces, local = {}, {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_fake(spec, info)
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"model.name: {spec.model.name} returned {type(model).__name__}, not a torch.nn.Module")
        blocks = _blocks(model, spec)
        params = _params(model, blocks)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        embed, tied = _embed_names(model, info)
        sample = tuple(t.numel() * t.element_size() for t in example_batch(info, 1))
        traces[1], local[1] = trace_model(spec, info, model, blocks, backward=False), params
        native = None
        if spec.precision in AUTOCAST_DTYPES:
            cast = build_fake(spec, info)
            for p in cast.parameters():  # not Module.to: it swaps tensors, which fake ones (weakly referenced) refuse
                p.data = p.data.to(AUTOCAST_DTYPES[spec.precision])
            native = trace_model(spec, info, cast, _blocks(cast, spec), backward=False, native=True)
    for degree in degrees:
        with _fake_group(degree) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
            split = _split_model(spec, info, degree, mesh)
            split_blocks = _blocks(split, spec)
            traces[degree] = trace_model(spec, info, split, split_blocks, backward=True)
            local[degree] = _params(split, split_blocks)  # after the traced backward: gradients' layouts known
    return Census(model=spec.model.name, params=params, n_blocks=len(blocks), embed=embed, tied=tied,
                  buffer_bytes=buffers, sample_bytes=sample, traces=traces, local_params=local,
                  tensor_degrees=(1, *degrees), native=native)


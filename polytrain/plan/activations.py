"""What a rank keeps for the backward pass, and which blocks and parameters a pipeline stage holds: the census'
traced regions turned into one micro-batch's activations (`activations`), the pipeline's stages as the cut takes
them (`stage_blocks`, `stage_params`) and how many micro-batches a stage holds at once (`in_flight`). Pure
arithmetic over a `polytrain.plan.census.Census`; `polytrain.plan.memory` and `comms` build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.plan.census import Census, Param

#: backends whose bf16/fp16 runs compute in that dtype (fsdp's MixedPrecisionPolicy casts the parameters it
#: gathers, DeepSpeed keeps bf16/fp16 weights); the rest compute under autocast from fp32 weights
NATIVE_BACKENDS = ("fsdp", "deepspeed")


def global_batch(spec_batch: int, spec_global: int | None, data: int, accum: int) -> int:
    """Samples per optimizer step of a spec whose layout has ``data`` data ranks: ``data.global_batch_size``, or
    ``data.batch_size`` per data rank per micro-step."""
    return spec_global if spec_global is not None else spec_batch * data * accum


def stage_blocks(census: Census, pipeline: int, chunks: int = 1,
                 boundaries: Sequence[int] | None = None) -> list[range]:
    """The block indices of each pipeline stage (`polytrain.spec.layout.balanced_boundaries`, as the pipeline cuts)."""
    from polytrain.spec.layout import balanced_boundaries

    stages = pipeline * chunks
    sizes = census.block_sizes()
    sizes[0] += census.embed_params
    cuts = tuple(boundaries) if boundaries is not None else balanced_boundaries(sizes, stages)
    edges = (0, *cuts, census.n_blocks)
    return [range(edges[i], edges[i + 1]) for i in range(stages)]


def stage_params(census: Census, tensor: int, blocks: range, first: bool, last: bool) -> list[Param]:
    """The (tensor rank 0) parameters of the stage holding ``blocks``: the modules ``embed`` uses go with the first
    stage, every other module outside the blocks with the last (`polytrain.adapters.torch.parallel.pipeline.cut`),
    which also holds its copy of a tied weight where it is not the first."""
    out = []
    for p in census.local_params[tensor]:
        if p.block is not None:
            keep = p.block in blocks
        else:
            keep = (first or (last and p.name in census.tied)) if p.name in census.embed else last
        if keep:
            out.append(p)
    return out


def activations(census: Census, tensor: int, checkpointing: bool, batch: float, blocks: range | None = None,
                first: bool = True, last: bool = True, native: bool = False) -> tuple[float, float]:
    """(bytes kept for the backward pass of one micro-batch of ``batch`` samples, the largest block's recompute
    under checkpointing) for a tensor-parallel rank of degree ``tensor`` holding ``blocks`` (all of them without a
    pipeline); ``native``: a backend computing in the low precision itself, not under autocast (`NATIVE_BACKENDS`;
    the tensor-parallel degrees are traced under autocast only)."""
    trace = census.native if native and tensor == 1 and census.native is not None else census.traces[tensor]
    blocks = range(census.n_blocks) if blocks is None else blocks
    total = (trace.pre.at(batch) if first else 0.0) + (trace.post.at(batch) if last else 0.0)
    if checkpointing and census.n_blocks:
        total += sum(trace.block_inputs[i].at(batch) for i in blocks)
        recompute = max((trace.blocks[i].at(batch) for i in blocks), default=0.0)
        return total, recompute
    return total + sum(trace.blocks[i].at(batch) for i in blocks), 0.0


def in_flight(schedule: str, microbatches: int, pipeline: int, stage: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once."""
    if schedule == "gpipe" or microbatches < pipeline:
        return microbatches
    return min(microbatches, pipeline - stage)

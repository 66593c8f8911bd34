"""The model-parallel package's pure parts, in one process with exact values: the qkv head-major order and the
portable form, the pipeline's stage cut, micro-batch counts, the data dimension's mesh split, and which backend the
registry makes for a layout (the multi-process parity is tests/multiproc/test_model_parallel.py)."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from polytrain import registry  # noqa: E402
from polytrain.adapters.torch.fsdp import data_mesh  # noqa: E402
from polytrain.adapters.torch.local import LocalBackend  # noqa: E402
from polytrain.adapters.torch.parallel.backend import ParallelBackend  # noqa: E402
from polytrain.adapters.torch.parallel.data import DDPDimension, FSDPDimension  # noqa: E402
from polytrain.adapters.torch.parallel.pipeline import cut, example_input, stage_ranges  # noqa: E402
from polytrain.adapters.torch.parallel.runner import microbatch_count  # noqa: E402
from polytrain.adapters.torch.parallel.state import clip_gradients, gather_stages  # noqa: E402
from polytrain.adapters.torch.parallel.tensor import (  # noqa: E402
    from_head_major,
    from_portable,
    to_head_major,
    to_portable,
)
from polytrain.errors import SpecError  # noqa: E402
from polytrain.protocols import DataShard  # noqa: E402
from polytrain.spec.backend_options import FSDPSpec  # noqa: E402
from polytrain.spec.layout import ParallelSpec, check_spec, grid_for  # noqa: E402
from polytrain.spec.tables import ModelSpec, TrainSpec  # noqa: E402
from polytrain.world import World  # noqa: E402

LM = ModelSpec(name="transformer", params={"n_heads": 4, "d_model": 32, "n_layers": 4, "tie_weights": False})

# qkv of 2 heads of width 2 (d_model 4): portable rows are [q0 q0 q1 q1 | k0 k0 k1 k1 | v0 v0 v1 v1]
PORTABLE_ROWS = list(range(12))
HEAD_MAJOR_ROWS = [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]  # [q0 k0 v0 | q1 k1 v1]


def spec_with(parallel: dict, *, backend: str = "ddp", sharding: str = "full_shard") -> TrainSpec:
    """What these parts read of a spec (the layout's rules against the spec are tests/test_layout.py's)."""
    layout = ParallelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in parallel.items()})
    return TrainSpec(backend=backend, model=LM, parallel=layout, fsdp=FSDPSpec(sharding=sharding))


# ---------------------------------------------------------------- tensor parallel: the qkv row order
def test_qkv_rows_go_head_by_head_and_back() -> None:
    weight = torch.arange(12 * 3).reshape(12, 3)
    bias = torch.arange(12)
    assert to_head_major(bias, 2).tolist() == HEAD_MAJOR_ROWS
    assert to_head_major(weight, 2)[:, 0].tolist() == [3 * row for row in HEAD_MAJOR_ROWS]
    assert torch.equal(to_head_major(weight, 2), weight[HEAD_MAJOR_ROWS])  # whole rows move, columns stay
    assert torch.equal(from_head_major(to_head_major(weight, 2), 2), weight)
    assert from_head_major(torch.tensor(HEAD_MAJOR_ROWS), 2).tolist() == PORTABLE_ROWS
    assert torch.equal(to_head_major(bias, 1), bias)  # one head: the orders agree


def test_a_contiguous_half_of_head_major_rows_is_whole_heads() -> None:
    """What the reorder is for: tensor rank r's contiguous slice of the rows holds q, k and v of its heads."""
    rows = to_head_major(torch.arange(4 * 3 * 2), 4).tolist()  # 4 heads of width 2: q rows 0-7, k 8-15, v 16-23
    assert rows[:12] == [0, 1, 8, 9, 16, 17, 2, 3, 10, 11, 18, 19]  # heads 0 and 1
    assert rows[12:] == [4, 5, 12, 13, 20, 21, 6, 7, 14, 15, 22, 23]  # heads 2 and 3


def test_attention_on_head_major_weights_computes_the_same_outputs() -> None:
    from polytrain.adapters.torch.transformer import CausalSelfAttention

    torch.manual_seed(0)
    plain = CausalSelfAttention(8, 4, 0.0)
    reordered = copy.deepcopy(plain)
    with torch.no_grad():
        for param in (reordered.qkv.weight, reordered.qkv.bias):
            param.copy_(to_head_major(param, 4))
    reordered.head_major = True
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(reordered(x), plain(x))


def test_the_portable_form_reorders_the_named_parameters_and_their_optimizer_slots_only() -> None:
    head_major = {"blocks.0.attn.qkv.weight": 2, "blocks.0.attn.qkv.bias": 2}
    rows = torch.tensor(HEAD_MAJOR_ROWS, dtype=torch.float32)
    held = {"blocks.0.attn.qkv.bias": rows, "blocks.0.attn.qkv.bias/exp_avg": rows,
            "blocks.0.attn.qkv.bias/step": torch.tensor(7.0), "blocks.0.attn.proj.bias": rows}
    portable = to_portable(held, head_major)
    assert portable["blocks.0.attn.qkv.bias"].tolist() == PORTABLE_ROWS
    assert portable["blocks.0.attn.qkv.bias/exp_avg"].tolist() == PORTABLE_ROWS
    assert float(portable["blocks.0.attn.qkv.bias/step"]) == 7.0  # a scalar slot is left alone
    assert portable["blocks.0.attn.proj.bias"].tolist() == HEAD_MAJOR_ROWS  # not a head-major parameter
    back = from_portable(portable, head_major)
    assert {key: value.tolist() for key, value in back.items()} == {key: value.tolist() for key, value in held.items()}
    assert all(value is held[key] for key, value in to_portable(held, {}).items())  # no tensor parallel: as it is


# ---------------------------------------------------------------- pipeline: where the model is cut
class Block(nn.Module):
    def __init__(self, extra: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)  # 20 parameters
        self.extra = nn.Parameter(torch.zeros(extra))  # weighs the block for the balance

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) + self.extra.sum()


class Toy(nn.Module):
    """``embed`` (inp: 12 parameters), blocks of 20, 20, 120, 20 parameters, ``finish`` (out)."""

    block_classes = (Block,)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(Block(extra) for extra in (0, 0, 100, 0))
        self.out = nn.Linear(4, 1)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.finish(h)


PATHS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


@pytest.mark.parametrize(("parallel", "ranges"), [
    # stage sizes by parameters: the embedding counts with block 0 (32, 20, 120, 20 of 192): the heavy block
    # 2 closes the first half
    ({"pipeline": 2}, [range(0, 3), range(3, 4)]),
    ({"pipeline": 2, "stage_boundaries": [1]}, [range(0, 1), range(1, 4)]),
    ({"pipeline": 2, "schedule": "interleaved_1f1b"}, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
])
def test_stage_ranges(parallel: dict, ranges: list[range]) -> None:
    assert stage_ranges(spec_with(parallel), Toy(), PATHS, {"inp"}) == ranges


def test_a_stage_cut_past_the_models_blocks_is_one_line() -> None:
    spec = spec_with({"pipeline": 2, "stage_boundaries": [3]})
    with pytest.raises(SpecError, match=r"^parallel.stage_boundaries: \[3\] cut past the model's 2 blocks "):
        stage_ranges(spec, Toy(), PATHS[:2], {"inp"})


def test_each_pipeline_rank_keeps_its_stages_under_the_models_names() -> None:
    spec = spec_with({"pipeline": 2, "stage_boundaries": [1]})
    torch.manual_seed(0)
    whole = Toy()
    x = torch.randn(3, 2)
    expected = whole(x)
    first, second = copy.deepcopy(whole), copy.deepcopy(whole)
    [(index0, stage0)] = cut(spec, first, torch.zeros(1, 2), 0)
    [(index1, stage1)] = cut(spec, second, torch.zeros(1, 2), 1)
    assert (index0, index1) == (0, 1)
    assert sorted(stage0.state_dict()) == ["blocks.0.extra", "blocks.0.lin.bias", "blocks.0.lin.weight", "inp.bias",
                                           "inp.weight"]
    assert sorted(stage1.state_dict()) == [f"blocks.{i}.{name}" for i in (1, 2, 3)
                                           for name in ("extra", "lin.bias", "lin.weight")] + ["out.bias", "out.weight"]
    # the model object itself is pruned to the stage: other blocks are Identity, other ends gone
    assert [type(block).__name__ for block in first.blocks] == ["Block", "Identity", "Identity", "Identity"]
    assert first.out is None and second.inp is None
    torch.testing.assert_close(stage1(stage0(x)), expected)


def test_interleaved_stages_go_round_robin_over_the_pipeline_ranks() -> None:
    spec = spec_with({"pipeline": 2, "schedule": "interleaved_1f1b"})  # 4 stages, 2 per rank
    assert [index for index, _ in cut(spec, Toy(), torch.zeros(1, 2), 0)] == [0, 2]
    assert [index for index, _ in cut(spec, Toy(), torch.zeros(1, 2), 1)] == [1, 3]


def test_the_example_input_has_the_datas_sample_shape_and_kind() -> None:
    tokens = example_input(SimpleNamespace(task="next_token", input_shape=(16,)))
    assert (tokens.shape, tokens.dtype) == (torch.Size([1, 16]), torch.long)
    features = example_input(SimpleNamespace(task="classification", input_shape=(3, 8, 8)))
    assert (features.shape, features.dtype) == (torch.Size([1, 3, 8, 8]), torch.float32)


@pytest.mark.parametrize(("samples", "most", "count"), [
    (32, 4, 4), (30, 4, 3), (7, 4, 1), (2, 4, 2), (5, 8, 5), (12, 8, 6), (1, 1, 1)])
def test_a_batch_is_cut_into_the_most_equal_microbatches_allowed(samples: int, most: int, count: int) -> None:
    assert microbatch_count(samples, most) == count


# ---------------------------------------------------------------- portable state across stages
def test_gathered_state_keeps_the_whole_models_order() -> None:
    mine = {"zz": torch.zeros(1), "a/step": torch.zeros(1), "b": torch.zeros(1), "a": torch.zeros(1),
            "a/exp_avg": torch.zeros(1)}
    assert list(gather_stages(mine, None, ["b", "a"])) == ["b", "a", "a/exp_avg", "a/step", "zz"]


def test_clipping_scales_by_the_global_norm() -> None:
    first, second = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    first.grad, second.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert clip_gradients([first, second], 10.0, None) == 5.0
    assert (float(first.grad), float(second.grad)) == (3.0, 4.0)  # under the limit: unchanged
    assert clip_gradients([first, second], 1.0, None) == 5.0
    torch.testing.assert_close(torch.cat([first.grad, second.grad]), torch.tensor([0.6, 0.8]))


# ---------------------------------------------------------------- the data dimension
def test_the_fsdp_dimension_takes_the_mesh_plain_fsdp_would() -> None:
    mesh = {("dp_replicate", "dp_shard"): "replicate × shard", "dp_shard": "shard"}
    assert {sharding: data_mesh(sharding, mesh) for sharding in ("full_shard", "shard_grad_op", "hybrid_shard",
                                                                  "no_shard")} == {
        "full_shard": "shard", "shard_grad_op": "shard", "hybrid_shard": "replicate × shard",
        "no_shard": "replicate × shard"}


@pytest.mark.parametrize(("dimension", "sharding", "local_size", "split"), [
    (DDPDimension, None, 8, (1, 2)),  # every data rank in the shard dimension
    (FSDPDimension, "full_shard", 8, (1, 2)),
    (FSDPDimension, "no_shard", 8, (2, 1)),
    (FSDPDimension, "hybrid_shard", 8, (1, 2)),  # one node: shard over every data rank
    (FSDPDimension, "hybrid_shard", 2, (2, 1)),  # a node per tensor group: replicate across the nodes
])
def test_the_data_ranks_of_a_grid_split_as_the_dimension_says(dimension: type, sharding: str | None, local_size: int,
                                                               split: tuple[int, int]) -> None:
    """A 2 (pipeline) × 2 (data) × 2 (tensor) grid of 8 ranks on nodes of ``local_size``; rank 0 asks."""
    table = {"backend": "fsdp", "sharding": sharding} if sharding else {}
    spec = spec_with({"tensor": 2, "pipeline": 2}, **table)
    world = World(rank=0, size=8, local_size=local_size, num_nodes=8 // local_size)
    grid = grid_for(spec.parallel, world.size, world.rank)
    assert dimension().split(LocalBackend(spec, world), grid) == split


# ---------------------------------------------------------------- which backend the registry makes
def test_the_spec_rule_takes_the_data_backends_from_the_rows_that_name_a_layout() -> None:
    assert registry.layout_backends("torch") == ("ddp", "fsdp")
    assert registry.layout_backends("tensorflow") == ()
    with pytest.raises(SpecError) as caught:  # a table of other rows: the rule follows them
        check_spec(ParallelSpec(tensor=2), framework="torch", backend="ddp", data_backends=("fsdp",), batch_size=None)
    assert str(caught.value) == "parallel.tensor: combines with backend fsdp (the data-parallel dimension), not 'ddp'"


@pytest.mark.parametrize(("backend", "name", "dimension"), [
    ("ddp", "ddp", DDPDimension), ("fsdp", "fsdp", FSDPDimension), ("auto", "ddp", DDPDimension)])
def test_a_layout_is_the_parallel_backend_given_its_data_dimension(backend: str, name: str, dimension: type) -> None:
    spec = spec_with({"tensor": 2}, backend=backend)
    made = registry.create_backend(spec, World(rank=3, size=4))
    assert type(made) is ParallelBackend and type(made.data) is dimension
    assert made.name == name  # what checkpoints record, as before layouts had rows
    assert made.data_shard == DataShard(count=2, index=1, reports=False)  # tensor rank 1 of data shard 1


def test_without_a_layout_each_rank_reads_its_own_shard() -> None:
    made = registry.create_backend(spec_with({}), World(rank=2, size=3))
    assert type(made).__name__ == "DDPBackend"
    assert made.data_shard == DataShard(count=3, index=2, reports=True)


def test_auto_choosing_a_backend_without_a_layout_is_one_line() -> None:
    with pytest.raises(SpecError) as caught:
        registry.create_backend(spec_with({"tensor": 2}, backend="auto"), World(rank=0, size=1))
    assert str(caught.value) == ("backend: 'local' (chosen by auto) does not combine with parallel.tensor/pipeline; "
                                 "set backend: ddp or fsdp")


# ---------------------------------------------------------------- the data-parallel micro-step (the default hook)
def test_the_default_micro_step_runs_forward_and_backward_of_the_scaled_summed_loss() -> None:
    backend = LocalBackend(TrainSpec(), World())
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    x, y = torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[0.0], [1.0]])

    def loss_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).sum()

    loss = backend.train_micro_step(model, x, y, loss_sum, 0.5, True, contextlib.nullcontext(), None)
    assert loss == 2.0  # outputs -1 and 2: (-1 - 0)² + (2 - 1)²
    # d/dw of 0.5 × Σ (w·x − y)²: 0.5 × 2 × ((−1)·[1, 1] + 1·[2, 0])
    assert model.weight.grad.tolist() == [[1.0, -1.0]]
    assert torch.equal(backend.eval_outputs(model, x, contextlib.nullcontext()), torch.tensor([[-1.0], [2.0]]))


# ---------------------------------------------------------------- pipeline: tied weights, V-shaped stages
@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_is_found_as_the_last_stages_copy_of_the_embedding(tied: bool) -> None:
    from polytrain.adapters.torch.parallel.pipeline import tied_weights
    from polytrain.adapters.torch.transformer import TransformerLM
    from polytrain.spec.zoo import TransformerParams

    model = TransformerLM(vocab=16, seq_len=8, params=TransformerParams(d_model=8, n_heads=2, tie_weights=tied))
    assert tied_weights(model, torch.zeros(1, 8, dtype=torch.long)) == (
        {"head.weight": "tok_emb.weight"} if tied else {})


@pytest.mark.parametrize(("schedule", "ranks"), [("1f1b", [0, 1]), ("interleaved_1f1b", [0, 1, 0, 1]),
                                                 ("interleaved_zero_bubble", [0, 1, 0, 1]), ("zbv", [0, 1, 1, 0]),
                                                 ("dualpipev", [0, 1, 1, 0])])
def test_stages_go_round_robin_or_in_a_v(schedule: str, ranks: list[int]) -> None:
    parallel = ParallelSpec(pipeline=2, schedule=schedule)
    assert [parallel.stage_rank(s) for s in range(2 * parallel.chunks)] == ranks
    grid = grid_for(parallel, 2, 0)
    assert grid.reports == (ranks[-1] == 0)  # the last stage's rank reports the loss

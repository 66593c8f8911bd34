"""The ``parallel`` table: its rules (one line naming the field), the rank grid and the stage balance."""

from __future__ import annotations

import subprocess
import sys

import pytest
from specs import lm

from polytrain import validation
from polytrain.errors import SpecError
from polytrain.spec import tables as spec_mod
from polytrain.spec.layout import ParallelSpec, balanced_boundaries, grid_for

LM = lm(tokens=None, data={"batch_size": 8}, tie_weights=False)  # the tiny LM, untied; its data is never loaded


MLP = {"model": {"name": "mlp"}, "data": {"name": "digits", "batch_size": 8}}


def spec_with(parallel: dict, **top: object) -> spec_mod.TrainSpec:
    return validation.from_dict({**LM, "backend": "ddp", "parallel": parallel, **top})


def test_grid_puts_tensor_innermost_then_data_then_pipeline() -> None:
    parallel = ParallelSpec(tensor=2, pipeline=2)
    cells = [grid_for(parallel, 8, rank) for rank in range(8)]
    assert [(g.stage, g.data_rank, g.tensor_rank) for g in cells] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert cells[0].shape == (2, 2, 2)
    # one rank per data shard reports its loss: tensor rank 0 of the last stage
    assert [g.rank for g in cells if g.reports] == [4, 6]


@pytest.mark.parametrize(("parallel", "size", "message"), [
    (ParallelSpec(tensor=2, pipeline=2), 6, "parallel: tensor 2 × pipeline 2 = 4 does not divide the world size 6"),
    (ParallelSpec(tensor=2, data=3), 4, "parallel.data: 3 × tensor 2 × pipeline 1 must equal the world size 4"),
])
def test_layouts_that_do_not_fit_the_world(parallel: ParallelSpec, size: int, message: str) -> None:
    with pytest.raises(SpecError, match="^" + message.replace("(", r"\(")):
        grid_for(parallel, size, 0)


def test_balanced_boundaries_follow_parameter_counts() -> None:
    assert balanced_boundaries([10, 10, 10, 10], 2) == (2,)
    assert balanced_boundaries([100, 1, 1, 1], 2) == (1,)  # a heavy first block is a stage of its own
    assert balanced_boundaries([1, 1, 1, 100], 2) == (3,)
    assert balanced_boundaries([5] * 8, 4) == (2, 4, 6)
    with pytest.raises(SpecError, match="parallel.pipeline: 3 stages need at least 3 blocks"):
        balanced_boundaries([1, 1], 3)


@pytest.mark.parametrize(("parallel", "top", "message"), [
    ({"schedule": "zigzag", "pipeline": 2}, {}, "parallel.schedule: "),
    ({"tensor": 2}, {"framework": "tensorflow", "backend": "auto"}, "parallel.tensor: tensor and pipeline parallel "
                                                                    "are PyTorch-only here"),
    ({"tensor": 2}, {"backend": "deepspeed"}, "parallel.tensor: combines with backend ddp or fsdp"),
    ({"tensor": 3}, {}, "parallel.tensor: 3 does not divide the transformer's 4 attention heads"),
    ({"pipeline": 2, "microbatches": 3}, {}, "parallel.microbatches: 3 must divide data.batch_size 8"),
    ({"microbatches": 2}, {}, "parallel.microbatches: only used with parallel.pipeline > 1"),
    ({"tensor_plan": "x.y:z"}, {}, "parallel.tensor_plan: only used with parallel.tensor > 1"),
    ({"pipeline": 2, "stage_boundaries": [1, 2]}, {}, "parallel.stage_boundaries: 2 stages need 1 boundaries"),
    ({"pipeline": 2, "stage_boundaries": [0]}, {}, "parallel.stage_boundaries: must increase and start above 0"),
    ({"pipeline": 2, "stages_per_rank": 2}, {}, "parallel.stages_per_rank: more than one model chunk per rank "
                                                "needs schedule interleaved_1f1b, "),
    ({"data": "most"}, {}, "parallel.data: expected auto or a positive integer"),
    # issue 32 item 2: the zero-bubble family
    ({"pipeline": 2, "schedule": "zbv", "stages_per_rank": 3}, {}, "parallel.stages_per_rank: schedule zbv runs "
                                                                   "exactly 2 chunks per rank (V-shaped), not 3"),
    ({"pipeline": 2, "schedule": "dualpipev", "microbatches": 2}, {}, "parallel.microbatches: schedule dualpipev "
                                                                      "needs at least as many micro-batches as stages (4)"),
    ({"pipeline": 2, "schedule": "interleaved_zero_bubble"}, {"backend": "fsdp"},
     "parallel.schedule: interleaved_zero_bubble with backend fsdp loses weight gradients"),
    ({"pipeline": 2, "schedule": "zbv"}, {"compile": {"enabled": True}},
     "compile.enabled: schedule zbv splits each backward into its input and weight halves"),
    # issue 26 item 7: a zoo model's blocks and plan are known from its parameters, before anything starts
    ({"pipeline": 4}, {}, "parallel.pipeline: 4 stages need at least 4 blocks; the model declares 2 "
                          "(model.params.n_layers)"),
    ({"pipeline": 2, "schedule": "interleaved_1f1b"}, {}, "parallel.pipeline: 4 stages (2 × 2 per rank) need at "
                                                          "least 4 blocks; the model declares 2"),
    ({"pipeline": 2, "stage_boundaries": [2]}, {}, "parallel.stage_boundaries: [2] cut past the model's 2 blocks "
                                                   "(model.params.n_layers); each boundary must be below 2"),
    ({"tensor": 2}, MLP, "parallel.tensor: model 'mlp' has no tensor-parallel plan built in; give "
                         "parallel.tensor_plan"),
    ({"pipeline": 2}, {**MLP, "model": {"name": "convnet"}}, "parallel.pipeline: model 'convnet' cannot be cut into "
                                                             "stages: it needs block_classes"),
])
def test_bad_layouts_are_one_line_errors(parallel: dict, top: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec_with(parallel, **top)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_zoo_model_that_fits_the_layout_is_accepted() -> None:
    deep = {"name": "transformer", "params": {"n_heads": 4, "d_model": 32, "n_layers": 4, "tie_weights": False}}
    assert spec_with({"pipeline": 2, "schedule": "interleaved_1f1b"}, model=deep).parallel.chunks == 2
    assert spec_with({"pipeline": 2, "stage_boundaries": [3]}, model=deep).parallel.stage_boundaries == (3,)
    assert spec_with({"pipeline": 2}).parallel.pipeline == 2  # 2 stages, 2 blocks
    # a plan of its own makes any model splittable; a factory's blocks are counted when it is built
    assert spec_with({"tensor": 2, "tensor_plan": "plans:mlp_plan"}, **MLP).parallel.tensor == 2


@pytest.mark.parametrize(("sharding", "local_size", "shape"), [
    ("full_shard", 8, (1, 2)), ("shard_grad_op", 8, (1, 2)), ("no_shard", 8, (2, 1)),
    ("hybrid_shard", 8, (1, 2)),  # one node of 8 holds both stages: each data group on one node
    ("hybrid_shard", 4, (1, 2)),  # a node per stage
    ("hybrid_shard", 2, (2, 1)),  # a node per tensor group: the data ranks replicate across nodes
])
def test_the_fsdp_table_on_the_data_dimension(sharding: str, local_size: int, shape: tuple[int, int]) -> None:
    """(replicate, shard) of the data dimension of a 2 × 2 × 2 grid on nodes of ``local_size`` processes."""
    pytest.importorskip("torch")
    from polytrain.adapters.torch.fsdp import data_mesh_shape

    assert data_mesh_shape(sharding, (2, 2, 2), 8 // local_size, local_size) == shape
    assert data_mesh_shape("hybrid_shard", (1, 4, 2), 2, 4) == (2, 2)  # shard within a node, replicate across
    with pytest.raises(SpecError, match=r"^fsdp.sharding: hybrid_shard needs each node to hold whole tensor groups"):
        data_mesh_shape("hybrid_shard", (1, 3, 2), 2, 3)  # a tensor group would span two nodes
    with pytest.raises(SpecError, match=r"^fsdp.sharding: hybrid_shard needs the same number of processes"):
        data_mesh_shape("hybrid_shard", (1, 3, 2), 4, 2)


def test_parallel_is_part_of_the_spec_digest_but_not_of_the_model_digest() -> None:
    plain, split = spec_with({}), spec_with({"tensor": 2})
    assert plain.digest() != split.digest()  # ranks must agree on the layout
    assert plain.model_digest() == split.model_digest()  # checkpoints move between layouts


def test_cli_exit_code_2_for_a_bad_layout(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "polytrain.cli", "train", "--set", "model.name=transformer",
                             "--set", "data.name=tokens", "--set", "parallel.tensor=3", "--set", f"output={tmp_path}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "polytrain: error: parallel.tensor: 3 does not divide the transformer's 4 attention heads "
        "(model.params.n_heads); each rank computes whole heads"]

"""FSDP2 options resolved from the spec: device meshes per sharding strategy, which modules become units."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from torch import nn  # noqa: E402

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch.fsdp import RESHARD_AFTER_FORWARD, find_unit_classes, mesh_shape  # noqa: E402
from polytrain.adapters.torch.transformer import Block, TransformerLM  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec.zoo import TransformerParams  # noqa: E402


@pytest.mark.parametrize(("sharding", "shape", "reshard"), [
    ("full_shard", (8,), True),
    ("shard_grad_op", (8,), False),
    ("hybrid_shard", (2, 4), True),  # replicate across the 2 nodes, shard within each
    ("no_shard", (8, 1), False),  # every rank holds everything: DDP semantics
])
def test_mesh_per_sharding_strategy(sharding: str, shape: tuple[int, ...], reshard: bool) -> None:
    assert mesh_shape(sharding, size=8, num_nodes=2, local_size=4) == shape
    assert RESHARD_AFTER_FORWARD[sharding] is reshard


def test_hybrid_shard_on_one_machine_is_one_row() -> None:
    assert mesh_shape("hybrid_shard", size=2, num_nodes=1, local_size=2) == (1, 2)


def test_hybrid_shard_needs_equal_nodes() -> None:
    with pytest.raises(SpecError, match="fsdp.sharding: hybrid_shard needs the same number of processes"):
        mesh_shape("hybrid_shard", size=5, num_nodes=2, local_size=2)


def lm() -> TransformerLM:
    return TransformerLM(vocab=16, seq_len=8, params=TransformerParams(d_model=8, n_heads=2, n_layers=3))


def test_zoo_model_declares_its_blocks() -> None:
    assert find_unit_classes(lm(), None) == (Block,)


def test_units_named_by_class_name_or_qualified_name() -> None:
    assert find_unit_classes(lm(), ("Block",)) == (Block,)
    assert set(find_unit_classes(lm(), ("polytrain.adapters.torch.transformer.Block", "LayerNorm"))) == \
        {Block, nn.LayerNorm}


def test_unknown_unit_class_lists_what_is_there() -> None:
    with pytest.raises(SpecError, match=r"fsdp.units: no module of class 'Blok' in the model \(its classes: .*Block"):
        find_unit_classes(lm(), ("Blok",))


def test_model_without_declared_blocks_is_one_unit() -> None:
    assert find_unit_classes(nn.Sequential(nn.Linear(2, 2)), None) == ()


def test_fsdp_table_is_checked() -> None:
    ok = validation.from_dict({"backend": "fsdp", "fsdp": {"sharding": "hybrid_shard", "units": ["Block"],
                                                           "activation_checkpointing": True}},
                              validate_components=False)
    assert ok.fsdp.units == ("Block",) and ok.fsdp.activation_checkpointing
    with pytest.raises(SpecError, match="fsdp.sharding: 'zero3' is not allowed"):
        validation.from_dict({"backend": "fsdp", "fsdp": {"sharding": "zero3"}}, validate_components=False)
    with pytest.raises(SpecError, match="fsdp: only used with backend 'fsdp', not 'auto'"):
        validation.from_dict({"fsdp": {"cpu_offload": True}}, validate_components=False)

"""Every TensorFlow backend reads one data shard per rank (`TFBackend.data_shard`: no model-parallel layouts)."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from polytrain import registry  # noqa: E402
from polytrain.protocols import DataShard  # noqa: E402
from polytrain.spec.tables import TrainSpec  # noqa: E402
from polytrain.world import World  # noqa: E402


@pytest.mark.parametrize(("backend", "world"), [("local", World()), ("tf-multiworker", World(rank=2, size=3))])
def test_one_shard_per_rank(backend: str, world: World) -> None:
    made = registry.create_backend(TrainSpec(framework="tensorflow", backend=backend), world)
    assert made.data_shard == DataShard(count=world.size, index=world.rank, reports=True)

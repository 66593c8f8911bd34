"""The model `TorchFramework.release` hands back when a run ends: plain, on the CPU, trained, and free of the job.

One process, backend local (the module trained in place and handed back) and a backend that remakes the module
(``alters_module``: it takes the script's module over, as fully_shard and deepspeed.initialize do, and the framework
hands back an outline of it filled with the trained state — never a second full copy held through the run). The
outline keeps the module's ties and its non-persistent buffers."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from polytrain.adapters.torch.framework import TorchFramework, fill_outline, outline  # noqa: E402
from polytrain.adapters.torch.local import LocalBackend  # noqa: E402
from polytrain.data.source import DatasetInfo  # noqa: E402
from polytrain.protocols import UserCode  # noqa: E402
from polytrain.validation import from_dict  # noqa: E402
from polytrain.world import World  # noqa: E402

INFO = DatasetInfo(input_shape=(6,), num_outputs=3, task="classification")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((6,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x) * self.scale)[:, :3]


class Remaking(LocalBackend):
    alters_module = True


def trained(backend_cls: type, model: nn.Module) -> tuple[TorchFramework, nn.Module | None]:
    spec = from_dict({"backend": "local", "optimizer": {"name": "sgd", "lr": 0.5}})
    fw = TorchFramework(spec, World(), backend_cls(spec, World()), user=UserCode(model=model))
    fw.build(INFO)
    x, y = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32), np.arange(8) % 3
    fw.train_micro_step(x, y, 1.0 / 8, sync=True)
    fw.optimizer_step(0.5, None)
    state = fw.export_state()
    return fw, fw.release(state)


@pytest.mark.parametrize("backend_cls", [LocalBackend, Remaking])
def test_release_hands_back_the_trained_model_and_lets_go_of_the_rest(backend_cls: type) -> None:
    torch.manual_seed(0)
    mine = Tied()
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    fw, model = trained(backend_cls, mine)
    # in place: the script's own module; remade: a new one of its class, never a copy made at build time
    assert (model is mine) == (backend_cls is LocalBackend) and type(model) is Tied
    assert model.head.weight is model.emb.weight  # ties kept
    assert not torch.equal(model.emb.weight, before["emb.weight"])  # trained
    assert torch.equal(model.emb.weight, mine.emb.weight.detach())  # the state the run ended on
    assert torch.equal(model.scale, torch.full((6,), 2.0))  # a buffer no state holds
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert fw.model is None and fw.optimizer is None and fw.release() is None
    assert model(torch.ones(2, 6)).shape == (2, 3)


def test_an_outline_costs_no_memory_and_filled_keeps_ties_and_unsaved_buffers() -> None:
    torch.manual_seed(0)
    model = Tied()
    shape = outline(model)
    assert all(p.is_meta for p in shape.parameters()) and shape.head.weight is shape.emb.weight
    assert torch.equal(shape.scale, torch.full((6,), 2.0))  # not in the state: copied as it is
    fill_outline(shape, {k: v + 1 for k, v in model.state_dict().items()})
    assert shape.head.weight is shape.emb.weight and not shape.emb.weight.is_meta
    assert torch.equal(shape.emb.weight, model.emb.weight + 1)
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for p in expected.parameters():  # the tied weight once: it is one parameter
            p.add_(1)
    assert torch.equal(shape(torch.ones(2, 6)), expected(torch.ones(2, 6)))

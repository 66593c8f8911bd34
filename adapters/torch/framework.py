"""The PyTorch framework adapter: model, optimizer, loss and one micro-step, through a backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from polytrain.adapters.torch.backend import TorchBackend
from polytrain.adapters.torch.models import build_model
from polytrain.protocols import DatasetInfo
from polytrain.spec import OptimizerSpec, TrainSpec
from polytrain.world import World


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The spec's meaning: ``adam`` weight decay is L2 added to the gradient; ``adamw`` is decoupled."""
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


class TorchFramework:
    def __init__(self, spec: TrainSpec, world: World, backend: TorchBackend) -> None:
        self.spec = spec
        self.world = world
        self.backend = backend
        self.device = backend.device

    def build(self, info: DatasetInfo) -> None:
        self.info = info
        torch.manual_seed(self.spec.seed)  # identical initial weights on every rank
        model = build_model(self.spec.model.name, self.spec.model.params, info).to(self.device)
        optimizer = make_optimizer(self.spec.optimizer, model.parameters())
        self.model, self.optimizer = self.backend.wrap(model, optimizer)
        torch.manual_seed(self.spec.seed + self.world.rank)  # per-rank randomness from here on
        self.regression = info.task == "regression"
        self.autocast_dtype = torch.bfloat16 if self.spec.precision == "bf16" else None

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _loss_sum(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = out.float()
        if self.regression:
            return F.mse_loss(out.reshape(-1), y, reduction="sum")
        return F.cross_entropy(out, y, reduction="sum")

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        self.model.train()
        xb, yb = self._tensors(x, y)
        with contextlib.nullcontext() if sync else self.backend.no_sync(self.model):
            with self._autocast():
                out = self.model(xb)
            loss = self._loss_sum(out, yb)
            self.backend.backward(loss * loss_scale)
        return float(loss.detach())

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = self.backend.clip_grad_norm(self.model, clip_norm) if clip_norm is not None else None
        self.backend.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float, int]:
        model = self.backend.unwrap(self.model)
        model.eval()
        xb, yb = self._tensors(x, y)
        with self._autocast():
            out = model(xb)
        loss = float(self._loss_sum(out, yb))
        if self.regression:
            return loss, 0.0, len(y)
        return loss, float((out.argmax(dim=1) == yb).sum()), len(y)

    def export_state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.backend.full_state(self.model).items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_state(self.model, _tensors(state))

    def export_optimizer_state(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self.backend.full_optimizer_state(self.model, self.optimizer).items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_optimizer_state(self.model, self.optimizer, _tensors(state))

    def rng_state(self) -> list[int]:
        return torch.get_rng_state().tolist()

    def set_rng_state(self, state: list[int]) -> None:
        torch.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def _tensors(state: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

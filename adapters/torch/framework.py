"""The PyTorch framework adapter: model, optimizer, loss and one micro-step, through a backend."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from polytrain import objectives
from polytrain.adapters.torch.backend import TorchBackend
from polytrain.adapters.torch.execution import check_compiler, checkpoint_blocks, checkpointing_on
from polytrain.adapters.torch.models import build_model
from polytrain.adapters.torch.objectives import evaluation, loss_fn, metric_fns
from polytrain.errors import SpecError
from polytrain.protocols import DatasetInfo, UserCode, data_shard_of
from polytrain.spec import OptimizerSpec, TrainSpec
from polytrain.world import World

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _build_model(name: str, params: Any, info: DatasetInfo) -> torch.nn.Module:
    if name == "transformer":
        from polytrain.adapters.torch.transformer import build_transformer
        from polytrain.zoo import model_params

        return build_transformer(model_params(name, params), info)
    return build_model(name, params, info)


def _live_model(model: Any, backend: TorchBackend) -> torch.nn.Module:
    """A model given to `polytrain.fit`: every rank starts from rank 0's weights (scripts seed differently)."""
    if callable(model) and not isinstance(model, torch.nn.Module):  # a function that builds it
        model = model()
    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"model: expected a torch.nn.Module for framework 'torch', got {type(model).__name__}")
    if backend.world.size > 1:
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        state = backend.broadcast_object(state if backend.world.rank == 0 else None)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return model


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The spec's meaning: ``adam`` weight decay is L2 added to the gradient; ``adamw`` is decoupled."""
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


class TorchFramework:
    def __init__(self, spec: TrainSpec, world: World, backend: TorchBackend, user: UserCode | None = None) -> None:
        self.spec = spec
        self.world = world
        self.backend = backend
        self.user = user or UserCode()
        self.device = backend.device

    def build(self, info: DatasetInfo) -> None:
        self.info = info
        torch.manual_seed(self.spec.seed)  # identical initial weights on every rank
        if self.user.model is not None:
            model = _live_model(self.user.model, self.backend).to(self.device)
        else:
            model = _build_model(self.spec.model.name, self.spec.model.params, info).to(self.device)
        self.backend.bind_data(info)
        if checkpointing_on(self.spec):  # before the backend wraps it: the same blocks on every backend
            checkpoint_blocks(self.spec, model)
        optimizer = make_optimizer(self.spec.optimizer, model.parameters())
        self.model, self.optimizer = self.backend.wrap(model, optimizer)
        if self.spec.compile.enabled:  # where the backend's layout needs it (see adapters/torch/execution.py)
            check_compiler(self.device)
            self.backend.compile_model(self.model, self.spec.compile.mode)
        # per-shard randomness from here on: the ranks of a tensor-parallel group draw the same dropout masks
        torch.manual_seed(self.spec.seed + data_shard_of(self.backend, self.world).index)
        self.loss_name = objectives.loss_name(self.spec.loss, info.task)
        self.loss = loss_fn(self.loss_name, self.user.loss)  # one value per sample
        self.metric_fns = metric_fns(objectives.metric_names(self.spec.metrics, info.task), self.user.metrics)
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.spec.precision)
        self.scaler = self.backend.grad_scaler()  # fp16: dynamic loss scaling, unless the backend owns it
        self.skipped_steps = 0
        self.updates = 0  # optimizer steps run by this process (applied or skipped)

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _loss_sum(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(out.float(), y).sum()

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        self.model.train()
        xb, yb = self._tensors(x, y)
        if self.backend.pipeline is not None:  # the pipeline schedule runs forward and backward of its stages
            with contextlib.nullcontext() if sync else self.backend.no_sync(self.model):
                loss = self.backend.pipeline.train(xb, yb, self._loss_sum, loss_scale, self._autocast())
                self.backend.after_backward()
            return loss
        timeline, activity = self.backend.timeline, self.backend.activity
        with contextlib.nullcontext() if sync else self.backend.no_sync(self.model):
            if activity is not None:
                activity.phase("forward")
            with timeline.span("forward", "compute"):
                with self._autocast():
                    out = self.model(xb)
                loss = self._loss_sum(out, yb)
                scaled = loss * loss_scale
            if activity is not None:
                activity.phase("backward")
            with timeline.span("backward", "compute", sync=sync):
                self.backend.backward(self.scaler.scale(scaled) if self.scaler is not None else scaled)
        return float(loss.detach())

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        norm = self.backend.clip_grad_norm(self.model, clip_norm) if clip_norm is not None else None
        if self.scaler is None:
            applied = self.backend.optimizer_step(self.optimizer)
        else:
            applied = self.backend.scaled_optimizer_step(self.optimizer, self.scaler)
        self.updates += 1
        if applied is False:  # fp16 overflow: the update was skipped (on every rank alike)
            self.skipped_steps += 1
            if self.world.rank == 0:
                print(f"polytrain: fp16 gradient overflow in update {self.updates} of this run: skipped "
                      f"({self.skipped_steps} so far), loss scale now {self.loss_scale()}", file=sys.stderr, flush=True)
        self.optimizer.zero_grad()  # set_to_none (torch 2 default; Horovod 0.28 takes no argument)
        return norm

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None when no loss scaling runs."""
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        return self.backend.loss_scale()

    def step_stats(self) -> dict[str, float]:
        """Numbers the Trainer may add to its step log: skipped (overflow) updates and the loss scale."""
        scale = self.loss_scale()
        return {} if scale is None else {"skipped_steps": float(self.skipped_steps), "loss_scale": scale}

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
        model = self.backend.unwrap(self.model)
        model.eval()
        xb, yb = self._tensors(x, y)
        # compile (spec) covers the training step; validation runs eager (no second compile for eval mode)
        eager = torch.compiler.set_stance("force_eager") if self.spec.compile.enabled else contextlib.nullcontext()
        with eager:
            if self.backend.pipeline is not None:
                out = self.backend.pipeline.forward(xb, self._autocast())
                if out is None:  # not the last stage: the last one reports
                    return {}
            else:
                with self._autocast():
                    out = model(xb)
        return evaluation(self.loss_name, self.loss, self.metric_fns, out, yb)

    def export_state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.backend.full_state(self.model).items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_state(self.model, _tensors(state))

    def export_optimizer_state(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self.backend.full_optimizer_state(self.model, self.optimizer).items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_optimizer_state(self.model, self.optimizer, _tensors(state))

    def loss_scaler_state(self) -> dict[str, float] | None:
        """fp16's dynamic loss scale and growth tracker (None without loss scaling), for checkpoints."""
        if self.scaler is None:
            return None
        return {key: float(value) for key, value in self.scaler.state_dict().items()}

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict({key: (int(value) if key in ("growth_interval", "_growth_tracker") else value)
                                         for key, value in state.items()})

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad()  # set_to_none (torch 2 default; Horovod 0.28 takes no argument)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every parameter, by portable name; no communication."""
        return self.backend.parameter_shapes(self.model)

    def grads_finite(self) -> bool:
        """Whether every gradient is finite, the same answer on every rank (see the backend's hook)."""
        return self.backend.grads_finite(self.model)

    def rng_state(self) -> list[int]:
        return torch.get_rng_state().tolist()

    def set_rng_state(self, state: list[int]) -> None:
        torch.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def _tensors(state: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

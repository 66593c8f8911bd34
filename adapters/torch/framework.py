"""The PyTorch framework adapter: model, optimizer, loss and one micro-step, through a backend (the torch backend
contract, `contract.TorchBackendContract`) and the precision component (`precision.Precision`)."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from polytrain.adapters.torch.contract import TorchBackendContract
from polytrain.adapters.torch.execution import check_compiler, checkpoint_blocks, checkpointing_on
from polytrain.adapters.torch.models import build_model
from polytrain.adapters.torch.objectives import evaluation, loss_fn, metric_fns
from polytrain.adapters.torch.precision import Precision
from polytrain.data.source import DatasetInfo
from polytrain.errors import SpecError
from polytrain.protocols import UserCode
from polytrain.spec import objectives as objectives
from polytrain.spec.tables import OptimizerSpec, TrainSpec
from polytrain.spec.user_code import call_user, user_name
from polytrain.world import World


def _build_model(name: str, params: Any, info: DatasetInfo) -> torch.nn.Module:
    if name == "transformer":
        from polytrain.adapters.torch.transformer import build_transformer
        from polytrain.spec.zoo import model_params

        return build_transformer(model_params(name, params), info)
    return build_model(name, params, info)


def live_model(model: Any, backend: TorchBackendContract) -> torch.nn.Module:
    """A model given to `polytrain.fit` or `polytrain.torch.Distributed.setup`: every rank starts from rank 0's
    weights (scripts seed differently)."""
    if callable(model) and not isinstance(model, torch.nn.Module):  # a function that builds it
        model = call_user("model", f"fit:{user_name(model)}", model)
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
    def __init__(self, spec: TrainSpec, world: World, backend: TorchBackendContract,
                 user: UserCode | None = None) -> None:
        self.spec = spec
        self.world = world
        self.backend = backend
        self.user = user or UserCode()
        self.device = backend.device

    def build(self, info: DatasetInfo) -> None:
        self.info = info
        torch.manual_seed(self.spec.seed)  # identical initial weights on every rank
        if self.user.model is not None:
            model = live_model(self.user.model, self.backend)
        else:
            model = _build_model(self.spec.model.name, self.spec.model.params, info)
        # what `release` hands back: the module itself where the backend trains it in place; where the backend
        # remakes it (sharding, engines, hooks, pipeline cuts: it takes the module over, as fully_shard and
        # deepspeed.initialize do) an outline of it (meta tensors: no memory) that gets the trained state at the
        # end, rather than a second full copy kept beside the sharded one for the whole run
        self._result = outline(model) if self.backend.alters_module else model
        model = model.to(self.device)
        self.backend.bind_data(info)
        if checkpointing_on(self.spec):  # before the backend wraps it: the same blocks on every backend
            checkpoint_blocks(self.spec, model)
        optimizer = make_optimizer(self.spec.optimizer, model.parameters())
        # before wrap: it tells the backend whether every step's gradients are checked (the non-finite policy)
        self.precision = Precision(self.spec, self.backend, checks_finite=self.spec.checks_finite)
        self.model, self.optimizer = self.backend.wrap(model, optimizer)
        if self.spec.compile.enabled:  # where the backend's layout needs it (see adapters/torch/execution.py)
            check_compiler(self.device)
            self.backend.compile_model(self.model, self.spec.compile.mode)
        # per-shard randomness from here on: the ranks of a tensor-parallel group draw the same dropout masks
        torch.manual_seed(self.spec.seed + self.backend.data_shard.index)
        self.loss_name = objectives.loss_name(self.spec.loss, info.task)
        self.loss = loss_fn(self.loss_name, self.user.loss)  # one value per sample
        self.metric_fns = metric_fns(objectives.metric_names(self.spec.metrics, info.task), self.user.metrics)

    def fresh_module(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """For an elastic re-form on a backend that bound the module to its group (``binds_module_to_group``: fsdp's
        DTensors live on the old mesh): a new module of the same classes from the outline, on the device with its
        tensors uninitialised (the caller loads its commit), its blocks checkpointed as at the start, and a new
        optimizer of the spec's over it; the fp16 scaler, which holds the old group on such a backend, is made
        anew."""
        module = copy.deepcopy(self._result).to_empty(device=self.device)
        if checkpointing_on(self.spec):
            checkpoint_blocks(self.spec, module)
        if self.precision.scaler is not None:
            self.precision.scaler = self.backend.grad_scaler()
        return module, make_optimizer(self.spec.optimizer, module.parameters())

    @property
    def scaler(self) -> Any:
        """fp16's loss scaler (None without one, or where the backend owns it): the precision's."""
        precision = getattr(self, "precision", None)
        return None if precision is None else precision.scaler

    @property
    def updates(self) -> int:
        """Optimizer steps run by this process (applied or skipped)."""
        return self.precision.updates

    @property
    def skipped_steps(self) -> int:
        """Updates skipped after an fp16 overflow."""
        return self.precision.skipped

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        xb = torch.from_numpy(x).to(self.device)
        return self.precision.convert_input(xb), torch.from_numpy(y).to(self.device)

    def _loss_sum(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(out.float(), y).sum()

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        if not (self.model.training and self.backend.unwrap(self.model).training):  # after `evaluate`, or a
            self.model.train()  # model given in eval mode: every module back in training mode, as Lightning does
        xb, yb = self._tensors(x, y)
        precision = self.precision
        return self.backend.train_micro_step(self.model, xb, yb, self._loss_sum, loss_scale, sync,
                                             precision.autocast(), precision.scaler)

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm, applied = self.precision.update(self.model, self.optimizer, clip_norm)  # unscale → clip → step
        if applied is False:  # fp16 overflow: the update was skipped (on every rank alike)
            if self.world.rank == 0:
                print(f"polytrain: fp16 gradient overflow in update {self.updates} of this run: skipped "
                      f"({self.skipped_steps} so far), loss scale now {self.loss_scale()}", file=sys.stderr, flush=True)
        self.optimizer.zero_grad()  # set_to_none (torch 2 default; Horovod 0.28 takes no argument)
        return norm

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None when no loss scaling runs."""
        return self.precision.loss_scale()

    def step_stats(self) -> dict[str, float]:
        """Numbers the Trainer may add to its step log: skipped (overflow) updates and the loss scale."""
        return self.precision.stats()

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
        model = self.backend.unwrap(self.model)
        model.eval()
        xb, yb = self._tensors(x, y)
        # compile (spec) covers the training step; validation runs eager (no second compile for eval mode)
        eager = torch.compiler.set_stance("force_eager") if self.spec.compile.enabled else contextlib.nullcontext()
        with eager:
            out = self.backend.eval_outputs(model, xb, self.precision.autocast())
        if out is None:  # a pipeline's stage before the last: the last one reports
            return {}
        return evaluation(self.loss_name, self.loss, self.metric_fns, out, yb)

    def release(self, state: Mapping[str, np.ndarray] | None = None) -> torch.nn.Module | None:
        """Drop this adapter's references into the job (the wrapped model, the optimizer, the loss scaler: DDP,
        FSDP and DeepSpeed hold the process group through them) and return the trained model: a plain module on
        the CPU, with no hook or tensor bound to the job, usable after the process group is gone. Where the
        backend trained the module in place (local, ddp, mpi) it is that module (the script's own, if it gave
        one); where the backend remade it (``alters_module``) it is a new module of the same classes filled with
        ``state`` (`export_state`, taken before; without it the model is None). A second call returns None."""
        plain, self._result = getattr(self, "_result", None), None
        model = getattr(self, "model", None)
        self.model = self.optimizer = None
        if getattr(self, "precision", None) is not None:
            self.precision.scaler = None  # FSDP's sharded scaler holds the process group
        if plain is None or model is None:
            return None
        if not self.backend.alters_module:
            return plain.cpu()
        if state is None:
            return None
        fill_outline(plain, _tensors(state))
        return plain.cpu()

    def export_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return {k: _copied(v.detach().cpu(), (into or {}).get(k)) for k, v in self.backend.full_state(self.model).items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_state(self.model, _tensors(state))

    def export_optimizer_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        state = self.backend.full_optimizer_state(self.model, self.optimizer)
        return {k: _copied(v, (into or {}).get(k)) for k, v in state.items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.backend.load_full_optimizer_state(self.model, self.optimizer, _tensors(state))

    def loss_scaler_state(self) -> dict[str, float] | None:
        """fp16's dynamic loss scale and growth tracker (None without loss scaling), for checkpoints."""
        return self.precision.state_dict()

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        self.precision.load_state_dict(state)

    def discard_gradients(self) -> None:
        self.precision.discard(self.optimizer)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every parameter, by portable name; no communication."""
        return self.backend.parameter_shapes(self.model)

    def grads_finite(self) -> bool:
        """Whether every gradient is finite, the same answer on every rank (see the backend's hook)."""
        return self.precision.grads_finite(self.model)

    def rng_state(self) -> dict[str, list[int]]:
        return rng_state(self.device)

    def set_rng_state(self, state: list[int] | Mapping[str, list[int]]) -> None:
        set_rng_state(state, self.device)


# ---------------------------------------------------------------- RNG state in checkpoints
# One rank's entry of a checkpoint's ``rng_states`` (the Trainer's and a hand-written loop's): ``{"cpu": [...],
# "cuda": [...]}``, each generator's state as a list of bytes (``torch.get_rng_state()``: 5056 for the CPU's
# Mersenne Twister; ``torch.cuda.get_rng_state(device)``: the rank's CUDA device's Philox seed and offset).
# ``"cuda"`` is there when the rank trained on a CUDA device (`cuda_generator`). An older checkpoint's entry is the
# CPU generator's list alone.


def cuda_generator(device: torch.device, available: bool) -> torch.device | None:
    """The CUDA device whose generator a rank's RNG state holds: the rank's own ``device`` when it is a CUDA device
    and CUDA is ``available`` (``torch.cuda.is_available()``), else None — a CPU rank keeps no CUDA generator (and
    asking for one would make it a CUDA context)."""
    return device if available and device.type == "cuda" else None


def rng_state(device: torch.device) -> dict[str, list[int]]:
    """This rank's RNG state for a checkpoint (see above): the CPU generator's, and ``device``'s CUDA one."""
    state = {"cpu": torch.get_rng_state().tolist()}
    cuda = cuda_generator(device, torch.cuda.is_available())
    if cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda).tolist()
    return state


def rng_problem(state: object) -> str:
    """What is wrong with one rank's RNG state as a checkpoint holds it ("" when nothing is)."""
    parts = {"cpu": state} if isinstance(state, list) else state
    if not isinstance(parts, Mapping) or "cpu" not in parts:
        return f"expected {{'cpu': [bytes], 'cuda': [bytes]}} or a list of bytes, got {type(state).__name__}"
    for name in ("cpu", "cuda"):
        value = parts.get(name, [0])
        if not isinstance(value, list) or not value or not all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in value):
            return f"its {name!r} generator's state is not a list of bytes (0–255)"
    size = torch.get_rng_state().numel()
    if len(parts["cpu"]) != size:
        return f"its 'cpu' generator's state has {len(parts['cpu'])} bytes; torch's has {size}"
    return ""


def set_rng_state(state: list[int] | Mapping[str, list[int]], device: torch.device) -> None:
    """Put back a rank's RNG state from `rng_state` (or an older checkpoint's list: the CPU generator alone).
    The CUDA generator's goes into ``device``'s; a rank resuming on the CPU skips it, and a CUDA rank resuming a
    state without one keeps its generator as seeded. ``ValueError`` (`rng_problem`) for a malformed state."""
    problem = rng_problem(state)
    if problem:
        raise ValueError(f"rng_states: {problem}")
    parts = {"cpu": state} if isinstance(state, list) else state
    torch.set_rng_state(torch.tensor(parts["cpu"], dtype=torch.uint8))
    cuda = cuda_generator(device, torch.cuda.is_available())
    if cuda is not None and "cuda" in parts:
        torch.cuda.set_rng_state(torch.tensor(parts["cuda"], dtype=torch.uint8), cuda)


def outline(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and persistent buffers are meta tensors (no memory): the shape of
    the plain model to load the trained state into (`TorchFramework.release`). Non-persistent buffers, which no
    state holds, are copied as they are."""
    memo: dict[int, Any] = {}
    for tensor in model.state_dict(keep_vars=True).values():
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def fill_outline(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Give an `outline` its tensors (``assign``: its meta tensors cannot take values), tying again what it tied."""
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    model.load_state_dict(dict(state), assign=True)
    for first, *others in (names for names in tied.values() if len(names) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)


def _tensors(state: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def _copied(tensor: torch.Tensor, spare: np.ndarray | None) -> np.ndarray:
    """A CPU tensor's values in an array of their own: ``spare``, when it fits, else a new one (filling memory
    already mapped costs a fraction of mapping new memory: 0.14 s against 1.2 s for 790 MB here)."""
    values = tensor.numpy()
    if spare is None or spare.shape != values.shape or spare.dtype != values.dtype:
        return values.copy()
    np.copyto(spare, values)
    return spare

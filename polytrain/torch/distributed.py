"""`Distributed`: the own-loop API over the Trainer's PyTorch backends (a second client of the same objects).

The backend is made, set up and torn down exactly as the Trainer does it (`registry.create_backend`, its
``setup``/``teardown``), and used through the same contract (`polytrain.adapters.torch.contract`); the registry
says which backends the own loop drives (``own_loop``). A script's model and optimizer go through the backend's
``wrap``; ``accumulate`` runs the non-final micro-steps under the backend's ``no_sync`` (DeepSpeed marks its
engine's accumulation boundary there); ``backward`` is the backend's (its gradient sync after the last micro-step
for horovod and mpi, DDP's and FSDP's hooks). Precision is the Trainer's component
(`polytrain.adapters.torch.precision`): the forward under autocast, the fp16 loss scaler in ``backward``,
unscale → clip in ``clip_grad_norm_``, the scaled step in the returned optimizer's ``step``, once per accumulation
window. Gradients are averaged over the ranks, as one process would average over the whole batch. A backend that
clips inside its step (``clips_in_step``: DeepSpeed) clips at the spec's ``loop.grad_clip_norm``.
Checkpoints (`save`/`load`) are the Trainer's (`polytrain.torch.checkpoints`).

Tensor parallel (``parallel={"tensor": T}``, ``ddp`` or ``fsdp`` the data dimension): the Trainer's layout backend
splits the model in ``setup`` (`polytrain.torch.layouts`); the ranks of a tensor group read the same shard, and
`gather_for_metrics` takes each shard's rows once (`all_reduce` is over every rank: a mean is the shards' mean).
Pipeline parallel stays with the Trainer (refused in one line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polytrain import registry, validation
from polytrain.adapters.torch.contract import TorchBackendContract
from polytrain.adapters.torch.precision import AUTOCAST_DTYPES, Precision, autocast
from polytrain.checkpoint import store as checkpoint
from polytrain.environments import detect_world
from polytrain.loop.checkpoints import LoopState
from polytrain.loop.session import LoopSession
from polytrain.loop.watch import LoopWatch
from polytrain.torch.elastic import ElasticLoop
from polytrain.torch.errors import OwnLoopError
from polytrain.torch.loaders import Loading, gather, sharded
from polytrain.world import World


class Distributed(LoopSession, ElasticLoop):
    """One process's place in a distributed job, for a loop the user writes.

    ``backend``: a torch backend name or ``"auto"``; ``precision``: ``fp32``/``bf16``/``fp16``;
    ``grad_accum_steps``: micro-steps per optimizer step (``accumulate``); ``parallel``: the spec's ``parallel``
    fields, e.g. ``{"tensor": 2, "tensor_plan": fn}`` (`polytrain.torch.layouts`); ``spec``: other spec fields as
    a dict (``reliability``, ``fsdp``, ...); ``world``: the World (default: what the launcher says).
    """

    def __init__(self, backend: str = "auto", *, precision: str = "fp32", grad_accum_steps: int = 1, seed: int = 0,
                 parallel: Mapping[str, Any] | None = None, spec: Mapping[str, Any] | None = None,
                 world: World | None = None) -> None:
        from polytrain.torch.layouts import loop_fields

        raw = {**dict(spec or {}), "framework": "torch", "backend": backend, "precision": precision, "seed": seed}
        raw["loop"] = {**dict(raw.get("loop") or {}), "grad_accum_steps": grad_accum_steps}
        raw, plan = loop_fields(raw, parallel)  # pipeline refused before the spec's model checks
        self.spec = validation.from_dict(raw)
        self._start(world)
        if plan is not None:
            self.backend.tensor_plan = plan  # the layout's, used when setup splits the model

    @classmethod
    def from_spec(cls, path: str | Path, world: World | None = None) -> Distributed:
        """The backend, precision, accumulation and options of a spec file (the fields the Trainer reads)."""
        from polytrain.spec.files import load_raw
        from polytrain.torch.layouts import loop_fields

        self = cls.__new__(cls)
        self.spec = validation.from_dict(loop_fields(load_raw(path), None)[0])
        if self.spec.framework != "torch":
            raise OwnLoopError(f"framework: {self.spec.framework!r} in {path}; polytrain.torch runs torch specs")
        self._start(world)
        return self

    @staticmethod
    def launch(main: Callable[..., Any], *args: Any, np: int) -> None:
        """Run ``main(*args)`` on ``np`` ranks of this machine: started here (``spawn``; guard the call with
        ``if __name__ == "__main__":``), or in this process when a launcher already started ``np`` of them.
        A rank that fails stops the others and raises `TrainingFailure` naming it."""
        from polytrain.torch.launch import launch

        launch(main, args, np)

    def _start(self, world: World | None) -> None:
        from polytrain.torch.layouts import check_loop_layout

        check_loop_layout(self.spec)
        self.world = world or detect_world()
        name, driven = registry.resolve_backend_name(self.spec, self.world), registry.own_loop_backends("torch")
        if name not in driven:
            raise OwnLoopError(f"backend: {name!r} is not in the own-loop API yet (it takes {', '.join(driven)})")
        self._watch = LoopWatch(self.world.rank, self.world.size)  # stall warnings, the lost rank named
        backend = registry.create_backend(self.spec, self.world, activity=self._watch.activity)
        self.backend: TorchBackendContract = backend  # type: ignore[assignment]  # a torch row's class
        self.accum = self.spec.loop.grad_accum_steps
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._precision: Precision | None = None  # made in `setup`, with the model
        self._micro = 0
        self._loading = Loading()
        self._sync = True
        self._inside = False
        self._ended = False
        self._owner = checkpoint.Owner(checkpoint.new_run_id())  # whose checkpoints `save` may replace and prune
        self._updates = 0  # optimizer steps taken (the activity's step numbers count from 1)
        with self._setting_up():
            self.backend.setup()
        self._hold()
        reliability = self.spec.reliability
        self._watch.start(self.backend, reliability.stall_warning_s, reliability.collective_timeout_s)

    # ------------------------------------------------------------------ who and where
    @property
    def device(self) -> torch.device:
        return self.backend.device

    # ------------------------------------------------------------------ model and optimizer
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, _Optimizer]:
        """The model (rank 0's weights on every rank, on the device) and its optimizer, as the backend runs them.
        Build the optimizer from ``model.parameters()`` first, as for plain DDP."""
        self._check_open("setup")
        if self._model is not None:
            raise OwnLoopError("setup: called twice; set up one model and its optimizer per Distributed")
        if not isinstance(model, nn.Module):
            raise OwnLoopError(f"setup: expected a torch.nn.Module, got {type(model).__name__}")
        own = {id(p) for p in model.parameters()}
        given = [p for group in optimizer.param_groups for p in group["params"]]
        if not given or any(id(p) not in own for p in given):
            raise OwnLoopError("setup: the optimizer was not built from this model's parameters; build it from "
                               "model.parameters() and pass both")
        from polytrain.adapters.torch.framework import live_model

        model = live_model(model, self.backend).to(self.device)  # rank 0's weights on every rank, as fit does
        if self._elastic and self.backend.binds_module_to_group:  # what a re-form makes a fresh module from
            from polytrain.adapters.torch.framework import outline

            self._outline = outline(model)
        precision = Precision(self.spec, self.backend)
        wrapped, inner = self.backend.wrap(model, optimizer)
        if precision.dtype is not None:  # the forward in the precision asked for, its outputs in fp32
            wrapped.forward = precision.forward(wrapped.forward)
        self._model, self._optimizer, self._precision = wrapped, inner, precision
        self._returned = _Optimizer(self, inner)
        if self.spec.parallel.model_parallel:  # a tensor group draws the same dropout masks, as in the Trainer
            torch.manual_seed(self.spec.seed + self.backend.data_shard.index)
        return wrapped, self._returned

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (bf16/fp16; nothing for fp32), for work outside the model's forward, which
        `setup` already runs under it (its floating outputs come back as fp32)."""
        return autocast(AUTOCAST_DTYPES.get(self.spec.precision), self.device.type)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module inside what `setup` returned."""
        return self.backend.unwrap(model)

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state by portable name, full tensors on the CPU (collective on sharded backends:
        every rank calls it)."""
        self._needs_setup("get_state_dict")
        return {k: v.detach().cpu() for k, v in self.backend.full_state(model).items()}

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """One micro-step of ``grad_accum_steps``: gradients are only synchronised on the last of a window, and
        the optimizer only steps there; ``backward`` divides the loss by the window's length."""
        self._needs_setup("accumulate")
        self._micro += 1
        self._sync = self._micro % self.accum == 0
        self._inside = True
        try:
            with self._watch.during("forward/backward", self._updates + 1):
                with contextlib.nullcontext() if self._sync else self.backend.no_sync(model):
                    yield
        finally:
            self._inside = False

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-step is the last of its window (the optimizer steps after it)."""
        return self._sync

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the backend runs it (scaled for fp16, divided over an accumulation window)."""
        self._needs_setup("backward")
        if self.accum > 1:
            if not self._inside:  # it would divide the loss, yet step every time: a silently smaller step
                raise OwnLoopError(f"backward: grad_accum_steps is {self.accum}; run each micro-step inside "
                                   "`with dist.accumulate(model):`")
            loss = loss / self.accum
        place = self._loading.place
        if place is not None and place.weight != 1.0:  # the ranks' shares of this step differ (an elastic rest)
            loss = loss * place.weight
        loss = self._precision.scale(loss)
        with self._watch.during("backward", self._updates + 1):
            self.backend.backward(loss)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float | None:
        """Clip the averaged (and, for fp16, unscaled) gradients; the total norm before clipping. Call it where
        the optimizer steps (a no-op returning None on the other micro-steps of a window)."""
        self._needs_setup("clip_grad_norm_")
        if self.backend.clips_in_step:  # it clips in its step, at the norm it was built with
            configured = self.spec.loop.grad_clip_norm
            if configured is None or abs(configured - max_norm) > 1e-12 * max(1.0, max_norm):
                raise OwnLoopError(f"clip_grad_norm_: {self.backend.name} clips inside its step, at the norm given "
                                   f"when the engine is built (loop.grad_clip_norm: {configured}); pass "
                                   f"spec={{'loop': {{'grad_clip_norm': {max_norm}}}}} to Distributed")
            return None
        if not self._sync:
            return None
        with self._watch.during("gradient clipping", self._updates + 1):  # unscaling and a sharded norm: collectives
            return self._precision.clip(model, self._optimizer, max_norm)

    # ------------------------------------------------------------------ data
    def setup_dataloaders(self, *loaders: torch.utils.data.DataLoader) -> Any:
        """Each loader re-made to read this rank's shard (a `DistributedSampler`: shuffled with the job's seed
        when the original shuffled, the epoch moved on at every pass over it). One loader in, one out."""
        made = [sharded(loader, self.backend.data_shard, self.spec.seed, self._loading) for loader in loaders]
        return made[0] if len(made) == 1 else tuple(made)

    def gather_for_metrics(self, data: Any) -> Any:
        """``data`` (a tensor, or a tuple/list/dict of them, one row per sample) from every rank, concatenated.
        Inside a loop over a loader from `setup_dataloaders`, exactly the set's samples, in the loader's order:
        the copies its sampler added to even out the ranks' shares are dropped, so a metric computed on the
        result equals the one-process value for any set size, batch size and world size."""
        self._check_open("gather_for_metrics")
        with self._watch.during("gather_for_metrics"):
            return gather(data, self.backend, self.world, self._loading.place)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over the ranks (sum, mean, max, min): a new tensor on its device."""
        with self._watch.during("all_reduce"):
            reduced = self._reduce(tensor.detach().double().cpu().numpy(), op)
        return torch.as_tensor(reduced).to(tensor.device, tensor.dtype)

    def barrier(self) -> None:
        with self._watch.during("barrier"):
            self.backend.barrier()

    # ------------------------------------------------------------------ checkpoints (the Trainer's)
    def save(self, path: str | Path, state: Mapping[str, Any], *, keep_last: int | None = None) -> Path:
        """Write ``state`` (the set-up model and optimizer, ``step``, ``epoch``, tensors, plain values) as a
        checkpoint under the root ``path``, in the Trainer's portable format (`polytrain.torch.checkpoints`); every
        rank calls it. Returns the checkpoint's directory."""
        self._needs_setup("save")
        from polytrain.torch.checkpoints import save

        with self._watch.during("the checkpoint save"):
            return save(self._loop_state(), path, state, keep_last)

    def load(self, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
        """Put a checkpoint (a loop's or the Trainer's; a step directory or the root holding them) into
        ``state``'s objects; returns its plain values with ``step`` and ``epoch``. Every rank calls it."""
        self._needs_setup("load")
        from polytrain.torch.checkpoints import load

        with self._watch.during("the checkpoint load"):
            return self._resumed(load(self._loop_state(), path, state))

    def _loop_state(self) -> LoopState:
        """What `save` and `load` work on (`polytrain.loop.checkpoints.LoopState`)."""
        return LoopState(self.backend, self.world, self.spec, self._model, self._optimizer, self._owner,
                         self.tracker_ids(), scaler=self._scaler, loading=self._loading)

    # ------------------------------------------------------------------ lifetime
    @property
    def _scaler(self) -> Any:
        """fp16's loss scaler (None before `setup`, without one, or where the backend owns it): the precision's."""
        return None if self._precision is None else self._precision.scaler

    def _release(self) -> None:
        self._model = self._optimizer = self._precision = None
        self._watch.close()

    def _needs_setup(self, verb: str) -> None:
        self._check_open(verb)
        if self._model is None:
            raise OwnLoopError(f"{verb}: called before setup(model, optimizer)")

    def _step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        if not self._sync:
            return None
        self._updates += 1
        with self._watch.during("the optimizer step", self._updates):
            applied = self._precision.step(optimizer)
        self._watch.activity.set(f"the script's own code after step {self._updates}")
        return applied


class _Optimizer:
    """The optimizer `setup` returns: ``step`` and ``zero_grad`` act once per accumulation window, through the
    backend; everything else is the optimizer's own."""

    wraps_optimizer = True  # how `save`/`load` tell it from other objects holding an ``optimizer`` (schedulers)

    def __init__(self, owner: Distributed, optimizer: torch.optim.Optimizer) -> None:
        self._owner, self.optimizer = owner, optimizer

    def step(self) -> bool | None:
        """The update (None inside an accumulation window; False when fp16 skipped an overflowed step)."""
        return self._owner._step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients set to None at the end of a window (Horovod's optimizer takes no ``set_to_none``; None is
        torch's default)."""
        if self._owner.sync_gradients:
            self.optimizer.zero_grad()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

"""What every PyTorch backend shares: device choice, the default hooks, gloo/NCCL collectives (the rendezvous
before them: `rendezvous`).

`TorchBackend` implements the torch backend contract (`contract.TorchBackendContract`, what the Trainer's framework
adapter and the own loop call); a backend subclasses it and overrides only the hooks it owns (``wrap``, ``no_sync``,
``backward``, ``optimizer_step``, ``full_state``, ...) and the flags that say what it does itself. The framework adapter runs a
micro-step through ``train_micro_step`` and validation through ``eval_outputs``: their defaults are the
data-parallel step (forward, then ``backward``, under ``no_sync`` except on a step's last micro-step); a model-parallel
layout overrides them with its pipeline schedule.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from polytrain.adapters.torch.contract import LossSum, StepFn
from polytrain.adapters.torch.precision import check_fp16_runs
from polytrain.adapters.torch.rendezvous import (
    import_before_group,
    let_go_of,
    listen_address,
    live_groups,
    rendezvous_error,
    rendezvous_store,
    store_prefix,
)
from polytrain.comm.net import keep_gloo_on_loopback
from polytrain.observe.timeline import NULL, Timeline
from polytrain.observe.watchdog import Activity, PeerBoard
from polytrain.protocols import DataShard, ready
from polytrain.spec.tables import TrainSpec
from polytrain.world import World

REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def choose_device(cuda_available: bool, local_rank: int) -> str:
    """``cuda:<local rank>`` when a GPU is there, else ``cpu``."""
    return f"cuda:{local_rank}" if cuda_available else "cpu"


def choose_process_group_backend(device: str, nccl_available: bool) -> str:
    """NCCL for GPU tensors when the build has it; gloo otherwise (CPU, or no NCCL)."""
    return "nccl" if device.startswith("cuda") and nccl_available else "gloo"


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no element of ``tensors`` is NaN or ±Inf, in one host sync: their sum (accumulated in fp32) is
    finite exactly then, as an Inf or NaN anywhere makes it Inf or NaN. A sum beyond fp32's range from finite
    values (gradients near 1e38) also counts as not finite, as such an update would be. Half the work of summing
    their norms (which overflow for values near 1e19) and a fraction of testing each element."""
    sums = [t.sum(dtype=torch.float32) for t in tensors if t.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


def rebuilt_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                      model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer — its class and every group's settings — over ``model``'s parameters as they are now,
    for a backend that replaced them (FSDP2's sharded ones); ``names``: parameter id → name before that. Its
    state is empty, as before the first step."""
    now = dict(model.named_parameters())
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [now[names[id(p)]] for p in group["params"]]}
              for group in optimizer.param_groups]
    return type(optimizer)(groups)


class SyncAfterLastBackward:
    """For backends that average gradients themselves, once per optimizer step: ``sync_gradients()``
    runs after the backward pass of the last micro-step (the one not run under ``no_sync``)."""

    _skip_sync = False

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._skip_sync, previous = True, self._skip_sync
        try:
            yield
        finally:
            self._skip_sync = previous

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self._skip_sync:
            # a named range in torch.profiler's trace (spec profile): these backends' collectives (mpi4py, real
            # Horovod's ops) are not c10d ops, which the profiler would show by itself
            with record_function(f"polytrain::{getattr(self, 'name', 'backend')} gradient sync"):
                self.sync_gradients()

    def sync_gradients(self) -> None:
        raise NotImplementedError


class TorchBackend:
    """The base of every PyTorch backend; implements `contract.TorchBackendContract` (which extends
    `polytrain.protocols.Backend`): the members are documented there."""

    name = "base"
    #: set by `setup` when a rendezvous store listens (see `listen_address`)
    listen_address: str | None = None
    #: whether the timeline records every torch.distributed collective (`tracing.CollectiveTracer`): for
    #: backends whose collectives a library issues (FSDP, DeepSpeed); the others record their own buckets
    traces_collectives = False
    #: whether ``wrap`` remakes the module itself (shards or partitions its parameters, adds hooks bound to the
    #: job): the framework then trains a copy of a module the script gave, which stays plain (`TorchFramework.release`)
    alters_module = False
    #: the DeviceMesh a backend built over its groups (fsdp, model-parallel layouts); see `teardown`
    mesh: Any = None
    #: set before ``wrap`` where the Trainer asks `grads_finite` after every step: a backend that reduces the
    #: gradients itself may check them as it does (ddp)
    checks_finite = False
    #: what a backend does itself (see the contract): none of it here
    weights_in_precision = False
    clips_in_step = False
    owns_loss_scaler = False
    binds_module_to_group = False
    #: an elastic worker's client of the driver's store, and its assignment (`elastic_group`); else None
    membership: Any = None

    @property
    def in_place_refusal(self) -> str | None:
        """Sharded or partitioned state (and any backend that does not say otherwise) cannot go on in place yet."""
        return (f"backend: {self.name!r} cannot recover in place under polytrain's elastic driver yet; use ddp or "
                "horovod")

    def __init__(self, spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
                 activity: Activity | None = None) -> None:
        self.spec = spec
        self.world = world
        self.timeline = timeline
        self.activity = activity
        self.data_shard = DataShard(world.size, world.rank)  # data parallel: one shard per rank
        cuda = torch.cuda.is_available()
        self.device = torch.device(choose_device(cuda, world.local_rank))
        if cuda:
            torch.cuda.set_device(self.device)

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Start the process group when there is more than one rank."""
        if self.traces_collectives and self.timeline.enabled and getattr(self, "_tracer", None) is None:
            from polytrain.adapters.torch.tracing import CollectiveTracer

            self._tracer = CollectiveTracer(self.timeline, self.activity).install()
        if not self.world.distributed or dist.is_initialized():
            return
        from polytrain.adapters.torch import elastic_group
        from polytrain.environments import ensure_master

        if elastic_group.form(self):  # a worker of polytrain's elastic driver: the group of its membership version
            return

        world = self.world = ensure_master(self.world)  # exact node ranks under MPI (FSDP's hybrid check)
        self._store_endpoint = (str(world.master_addr), int(world.master_port))
        keep_gloo_on_loopback(world.master_addr)
        self.listen_address = listen_address(world)
        reliability = self.spec.reliability
        try:
            store = rendezvous_store(world, timeout=datetime.timedelta(seconds=reliability.startup_timeout_s))
        except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError, or our loopback bind
            raise rendezvous_error(exc, world, reliability.startup_timeout_s) from None
        store.set_timeout(datetime.timedelta(seconds=reliability.collective_timeout_s))
        timeout = datetime.timedelta(seconds=reliability.collective_timeout_s)
        import_before_group()
        dist.init_process_group(
            backend=choose_process_group_backend(str(self.device), dist.is_nccl_available()),
            store=store,
            rank=world.rank,
            world_size=world.size,
            timeout=timeout,
        )
        self._owns_group = True

    def ensure_process_group(self) -> None:
        """A one-rank process group when `setup` started none (a single process), for backends whose library
        needs one anyway (DDP, FSDP, DeepSpeed). Its store is in-process (no port): a ``tcp://`` init would,
        under ``torchrun --nproc_per_node 1`` (TORCHELASTIC_USE_AGENT_STORE), wait as a client of a store
        nobody serves."""
        if dist.is_initialized():
            return
        import_before_group()
        dist.init_process_group(
            backend=choose_process_group_backend(str(self.device), dist.is_nccl_available()),
            store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
        self._owns_group = True

    @property
    def label(self) -> str:
        return self.name

    def progress_board(self) -> PeerBoard | None:
        """A store client of its own (for the stall watchdog's thread) on the store the ranks met in."""
        endpoint = getattr(self, "_store_endpoint", None)
        if endpoint is None:
            return None
        from polytrain.observe.watchdog import StoreBoard

        client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=3))
        return StoreBoard(dist.PrefixStore(f"{store_prefix()}/watchdog", client))

    def teardown(self) -> None:
        """Destroy the process groups this backend started, and let go of them: a group ends (its gloo threads
        joined, its store closed) only when nothing holds it any more. A DeviceMesh keeps its groups in a registry
        of its own, and DTensor's caches keep the mesh for the life of the process, so that registry is emptied;
        the objects an own-loop script still holds let go of them (`rendezvous.let_go_of`)."""
        tracer = getattr(self, "_tracer", None)
        if tracer is not None:
            tracer.remove()
            self._tracer = None
        ended = []
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            ended = live_groups()
            dist.destroy_process_group()
            self._owns_group = False
        registry = getattr(self.mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
        self.mesh = None
        let_go_of(ended)  # what a script kept (its FSDP2 model, ...) holds the groups no more: they end here

    # ---------------------------------------------------------------- training hooks
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def bind_data(self, info: Any) -> None:
        """Told the dataset's `DatasetInfo` before `wrap` (a layout that cuts the model needs an example input)."""

    def parameter_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every parameter, by portable name; no communication."""
        return {name: tuple(getattr(p, "ds_shape", None) or p.shape)
                for name, p in self.unwrap(model).named_parameters()}

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """``torch.compile`` (spec ``compile``) the wrapped model in place: here the model itself."""
        from polytrain.adapters.torch.execution import compile_module

        compile_module(self.unwrap(model), mode)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def train_micro_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_sum: LossSum, scale: float,
                         sync: bool, autocast: contextlib.AbstractContextManager[Any], scaler: Any | None) -> float:
        """Forward and backward of one micro-batch (`Framework.train_micro_step`); returns the summed loss of its
        samples. The backward pass runs on ``loss_sum(model(x), y) * scale`` (through fp16's ``scaler`` when there
        is one), under `no_sync` unless ``sync``: the data-parallel step, through `backward`. A layout whose
        schedule runs the forward and backward passes itself (a pipeline) overrides this."""
        timeline, activity = self.timeline, self.activity
        with contextlib.nullcontext() if sync else self.no_sync(model):
            if activity is not None:
                activity.phase("forward")
            with timeline.span("forward", "compute"):
                with autocast:
                    out = model(x)
                loss = loss_sum(out, y)
                scaled = loss * scale
            if activity is not None:
                activity.phase("backward")
            with timeline.span("backward", "compute", sync=sync):
                self.backward(scaler.scale(scaled) if scaler is not None else scaled)
        return float(loss.detach())

    def eval_outputs(self, model: nn.Module, x: torch.Tensor,
                     autocast: contextlib.AbstractContextManager[Any]) -> torch.Tensor | None:
        """The outputs of the plain (`unwrap`-ped) ``model`` for ``x``, forward only; None on a rank that holds no
        outputs (a pipeline's stages before the last: the last one reports)."""
        with autocast:
            return model(x)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: StepFn | None = None) -> bool | None:
        """Apply the update: ``step(optimizer)`` (a loss scaler's) or ``optimizer.step()``."""
        if step is None:
            optimizer.step()
        else:
            step(optimizer)
        return None

    # ---------------------------------------------------------------- fp16 loss scaling
    def grad_scaler(self) -> Any:
        """fp16's dynamic loss scaler (asked only for fp16, by `adapters.torch.precision`).

        Gradients must be identical on every rank when it checks them for inf/NaN (true
        after DDP's all-reduce); a backend with sharded gradients returns a scaler that
        agrees across ranks."""
        check_fp16_runs(self.device)
        return torch.amp.GradScaler(self.device.type)

    def loss_scale(self) -> float | None:
        """The loss scale of a backend that owns its fp16 scaler (``owns_loss_scaler``)."""
        return None

    def grads_finite(self, model: nn.Module) -> bool:
        """True when no gradient holds a NaN or Inf.

        Data-parallel backends hold the same averaged gradients on every rank after the sync, so the
        local answer is everyone's answer; sharded backends override this with an all-reduce.
        """
        return all_finite([p.grad for p in self.unwrap(model).parameters() if p.grad is not None])

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state (collective on sharded backends)."""
        return dict(self.unwrap(model).state_dict())

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(dict(state))

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Optimizer state as ``<parameter name>/<state key>`` → tensor (collective on sharded backends)."""
        names = {id(p): n for n, p in self.unwrap(model).named_parameters()}
        out = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in optimizer.state.get(param, {}).items():
                    out[f"{names[id(param)]}/{key}"] = torch.as_tensor(value).detach().cpu()
        return out

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.unwrap(model).named_parameters())
        for key, value in state.items():
            name, _, slot = key.rpartition("/")
            if name not in params:
                from polytrain.checkpoint.store import CheckpointError

                raise CheckpointError(f"checkpoint: optimizer state for unknown parameter {name!r}")
            param = params[name]
            # Adam's `step` stays a CPU scalar tensor, as torch keeps it; moments follow the parameter.
            tensor = value.clone() if value.ndim == 0 else value.to(param.device, param.dtype)
            optimizer.state[param][slot] = tensor

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return self.start_all_reduce(values, op)()

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        """`all_reduce` as an asynchronous collective on the default group: gloo's or NCCL's own thread runs it
        while the caller goes on (the Trainer's logging window: during the optimizer step)."""
        if not dist.is_initialized():
            return ready(np.asarray(values))
        # a copy that torch owns: a numpy-backed tensor is freed through Python (the GIL), and gloo's worker may free
        # it after the collective returns, while the main thread holds the GIL freeing the group: a hang at exit
        tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=self.device)
        work = dist.all_reduce(tensor, op=getattr(dist.ReduceOp, REDUCE_OPS[op]), async_op=True)

        def finish() -> np.ndarray:
            work.wait()
            return tensor.cpu().numpy()
        return finish

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

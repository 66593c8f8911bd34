"""What every PyTorch backend shares: device choice, the default hooks, gloo/NCCL collectives.

A backend subclasses `TorchBackend` and overrides only the hooks it owns
(``wrap``, ``no_sync``, ``backward``, ``optimizer_step``, ``full_state``, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from polytrain.environments import restart_count
from polytrain.net import is_loopback, keep_gloo_on_loopback, listening_socket
from polytrain.spec import TrainSpec
from polytrain.timeline import NULL, Timeline
from polytrain.watchdog import Activity, PeerBoard
from polytrain.world import World

REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def choose_device(cuda_available: bool, local_rank: int) -> str:
    """``cuda:<local rank>`` when a GPU is there, else ``cpu``."""
    return f"cuda:{local_rank}" if cuda_available else "cpu"


def choose_process_group_backend(device: str, nccl_available: bool) -> str:
    """NCCL for GPU tensors when the build has it; gloo otherwise (CPU, or no NCCL)."""
    return "nccl" if device.startswith("cuda") and nccl_available else "gloo"


def check_fp16_runs(device: torch.device) -> None:
    """Raise a one-line error when fp16 autocast cannot run on ``device`` (old CPUs / builds)."""
    from polytrain.errors import BackendUnavailableError

    try:
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            out = torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        if out.dtype != torch.float16:
            raise RuntimeError(f"autocast produced {out.dtype}")
    except RuntimeError as exc:
        reason = " ".join(str(exc).split())[:120]
        raise BackendUnavailableError(f"precision: fp16 cannot run on {device} here ({reason}); use bf16 or fp32") \
            from None


def rendezvous_store(world: World, timeout: datetime.timedelta) -> dist.Store:
    """The TCPStore the process group meets in, with keys scoped to this (re)start of the job.

    Under torchrun the elastic agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it
    across worker restarts; without a per-restart prefix, restarted workers would read the dead
    workers' addresses. Elsewhere rank 0 hosts it at the World's master address and port — on a
    loopback master only on that address (TCPStore alone would listen on every interface).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = world.rank == 0 and not agent_store
    listen_fd = None
    if hosting and is_loopback(str(world.master_addr)):
        listen_fd = listening_socket(str(world.master_addr), int(world.master_port), max(128, world.size)).fileno()
    store = dist.TCPStore(str(world.master_addr), int(world.master_port), world.size, is_master=hosting,
                          timeout=timeout, master_listen_fd=listen_fd)
    return dist.PrefixStore(store_prefix(), store)


def listen_address(world: World) -> str:
    """Where this job's rendezvous and collectives listen (for the start-up log)."""
    if is_loopback(str(world.master_addr)):
        return f"{world.master_addr}:{world.master_port} (single node: loopback only)"
    return f"all interfaces, port {world.master_port} (multi-node; master {world.master_addr})"


def rendezvous_error(exc: BaseException, world: World, timeout_s: float) -> Exception:
    """One line saying why the ranks did not meet at the master, and what to check."""
    from polytrain.errors import RendezvousError

    where = f"{world.master_addr}:{world.master_port}"
    text = str(exc)
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        return RendezvousError(
            f"rendezvous: rank {world.rank} cannot listen on MASTER_PORT {world.master_port} at {world.master_addr}: "
            "the port is in use by another process; choose another MASTER_PORT (polytrain launch picks a free one)")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return RendezvousError(
            f"rendezvous: only {joined.group(1)} of {joined.group(2)} ranks reached the master {where} within "
            f"{timeout_s:g} s (reliability.startup_timeout_s); check that every rank was started and that they agree "
            f"on the world size (-np / WORLD_SIZE={world.size})")
    if "timed out" in text.lower() or "connect" in text.lower():
        return RendezvousError(
            f"rendezvous: rank {world.rank} cannot reach the master at {where} within {timeout_s:g} s "
            "(reliability.startup_timeout_s); check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that "
            "the port is open between the hosts")
    return RendezvousError(f"rendezvous at {where} failed: {text.strip().splitlines()[0][:200]}")


def store_prefix() -> str:
    """Keys of this (re)start of the job: ``polytrain/restart_<n>``."""
    return f"polytrain/restart_{restart_count()}"


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
            self.sync_gradients()

    def sync_gradients(self) -> None:
        raise NotImplementedError


class TorchBackend:
    """The base of every PyTorch backend; implements `polytrain.protocols.Backend`."""

    name = "base"
    #: a pipeline-parallel layout's runner (`parallel.runner.PipelineRunner`): it runs the micro-steps
    pipeline: Any = None
    #: set by `setup` when a rendezvous store listens (see `listen_address`)
    listen_address: str | None = None
    #: whether the timeline records every torch.distributed collective (`tracing.CollectiveTracer`): for
    #: backends whose collectives a library issues (FSDP, DeepSpeed); the others record their own buckets
    traces_collectives = False

    def __init__(self, spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
                 activity: Activity | None = None) -> None:
        self.spec = spec
        self.world = world
        self.timeline = timeline
        self.activity = activity
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
        from polytrain.environments import ensure_master

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
        from polytrain.watchdog import StoreBoard

        client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=3))
        return StoreBoard(dist.PrefixStore(f"{store_prefix()}/watchdog", client))

    def teardown(self) -> None:
        tracer = getattr(self, "_tracer", None)
        if tracer is not None:
            tracer.remove()
            self._tracer = None
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    # ---------------------------------------------------------------- training hooks
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

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

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Apply the update; a backend that may skip it (its own fp16 scaler) returns whether it applied it."""
        optimizer.step()
        return None

    # ---------------------------------------------------------------- fp16 loss scaling
    def grad_scaler(self) -> Any | None:
        """The dynamic loss scaler for precision fp16 (None otherwise, or when the backend scales itself).

        Gradients must be identical on every rank when it checks them for inf/NaN (true
        after DDP's all-reduce); a backend with sharded gradients returns a scaler that
        agrees across ranks."""
        if self.spec.precision != "fp16":
            return None
        check_fp16_runs(self.device)
        return torch.amp.GradScaler(self.device.type)

    def scaled_optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: Any) -> bool:
        """Step unless the gradients overflowed; update the scale. Returns whether the update was applied."""
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= before  # the scale only shrinks after an overflow (a skipped step)

    def loss_scale(self) -> float | None:
        """The loss scale of a backend that owns its fp16 scaler (see `grad_scaler`)."""
        return None

    def grads_finite(self, model: nn.Module) -> bool:
        """True when no gradient holds a NaN or Inf.

        Data-parallel backends hold the same averaged gradients on every rank after the sync, so the
        local answer is everyone's answer; sharded backends override this with an all-reduce.
        """
        grads = [p.grad for p in self.unwrap(model).parameters() if p.grad is not None]
        if not grads:
            return True
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))

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
                from polytrain.checkpoint import CheckpointError

                raise CheckpointError(f"checkpoint: optimizer state for unknown parameter {name!r}")
            param = params[name]
            # Adam's `step` stays a CPU scalar tensor, as torch keeps it; moments follow the parameter.
            tensor = value.clone() if value.ndim == 0 else value.to(param.device, param.dtype)
            optimizer.state[param][slot] = tensor

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        if not dist.is_initialized():
            return np.asarray(values)
        tensor = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(self.device)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, REDUCE_OPS[op]))
        return tensor.cpu().numpy()

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

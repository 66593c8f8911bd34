"""``deepspeed``: DeepSpeed ZeRO 0–3, CPU or NVMe offload (`zero_infinity`), on CPU (gloo) or GPU (NCCL).

The DeepSpeed config is generated from the spec (`deepspeed_config`); ``deepspeed.config``
is merged over it key by key, and rank 0 writes the result to
``<output>/deepspeed_config.json``. polytrain keeps control of what must match the
other backends:

- the optimizer is polytrain's own torch optimizer, handed to ``deepspeed.initialize``
  (so every backend runs the same update code), its learning rate set every step;
- the loss: ``engine.backward(loss, scale_wrt_gas=False)`` — the Trainer's loss is
  already scaled for exact averaging, DeepSpeed must not divide it by the
  accumulation steps again; DeepSpeed averages gradients over ranks like DDP;
- accumulation: the Trainer's last micro-step is the boundary
  (``set_gradient_accumulation_boundary``), whatever DeepSpeed's step counter says;
- clipping: ``gradient_clipping`` is always written (0.0 = off), since DeepSpeed's
  default has changed between releases; DeepSpeed clips inside ``engine.step()``.

On CPU DeepSpeed's accelerator is ``cpu`` and collectives go through the gloo group polytrain starts. The shared-memory op DeepSpeed compiles at start-up on CPU
(``deepspeed_shm_comm``, ~2 min) serves only its inference all-reduce, so it is skipped; JIT-built ops that remain
(e.g. ``cpu_adam`` if a config override asks for it) are cached under ``~/.cache/polytrain/torch_extensions``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from polytrain.adapters.torch import zero_infinity
from polytrain.adapters.torch.backend import TorchBackend, all_finite
from polytrain.adapters.torch.rendezvous import let_go_of, live_groups
from polytrain.errors import BackendUnavailableError, SpecError
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.spec.backend_options import check_owned
from polytrain.spec.tables import TrainSpec

EXTENSIONS_DIR = Path.home() / ".cache" / "polytrain" / "torch_extensions"
CONFIG_FILE = "deepspeed_config.json"
CHECKPOINT_DIR = "deepspeed_checkpoint"
NEVER = 2**31 - 1  # steps_per_print: polytrain does the logging


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in: tables merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def deepspeed_config(spec: TrainSpec, world_size: int, on_gpu: bool, nvme: Path | None = None) -> dict[str, Any]:
    """The DeepSpeed config for ``spec`` on ``world_size`` ranks, ``spec.deepspeed.config`` merged over it
    (``nvme``: the job's folder of offloaded files, `zero_infinity.prepare`)."""
    ds, loop, data = spec.deepspeed, spec.loop, spec.data
    accum = loop.grad_accum_steps
    micro = data.batch_size
    if data.global_batch_size is not None:  # DeepSpeed's train_batch_size is the Trainer's global batch, exactly
        micro, left = divmod(data.global_batch_size, world_size * accum)
        if left or not micro:
            raise SpecError(
                f"data.global_batch_size: {data.global_batch_size} must be a multiple of world size × "
                f"loop.grad_accum_steps = {world_size} × {accum} = {world_size * accum} on backend deepspeed "
                f"(DeepSpeed's train_batch_size is micro-batch × accumulation × world size)")
    zero: dict[str, Any] = {"stage": ds.stage}
    for key in ("offload_optimizer", "offload_param"):  # cpu, or nvme (zero_infinity: files on a drive)
        if (section := zero_infinity.offload_section(spec, key, on_gpu, nvme)) is not None:
            zero[key] = section
    generated = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "gradient_clipping": float(loop.grad_clip_norm or 0.0),
        "zero_optimization": zero,
        "bf16": {"enabled": spec.precision == "bf16"},
        # Dynamic loss scaling with torch.amp.GradScaler's settings: start at 2^16, halve on
        # overflow (hysteresis 1), double after 2000 clean steps.
        "fp16": {"enabled": spec.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1},
        # polytrain's torch optimizer on every backend (same update code): ZeRO must accept it,
        # also with offload (where DeepSpeed would otherwise insist on its compiled CPU Adam).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }
    if (aio := zero_infinity.aio_section(spec)) is not None:
        generated["aio"] = aio
    merged = merge(generated, ds.config)
    for key, field_name in (("train_micro_batch_size_per_gpu", "data.batch_size"),
                            ("train_batch_size", "data.global_batch_size")):
        check_owned(ds.config, (key,), field_name, generated[key])
    return merged


def _prepare_environment(device: torch.device) -> None:
    """Before DeepSpeed is imported: its accelerator on CPU, and where JIT-built ops are cached."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))


def _import_deepspeed() -> Any:
    """``import deepspeed``, without the MLflow import its autotuner (which polytrain never runs) makes when MLflow
    is installed: ~2 s of CPU in every rank. MLflow imported already (a tracker) is left as it is."""
    hide = "mlflow" not in sys.modules and "deepspeed" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # its `import mlflow` fails; it carries on without
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def _skip_shm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory op: only its inference all-reduce uses it."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


class DeepSpeedBackend(TorchBackend):
    name = "deepspeed"
    traces_collectives = True  # the library issues them: the timeline records each
    alters_module = True  # the engine partitions parameters, tags them with its groups and hooks the module
    weights_in_precision = True  # bf16/fp16: the engine's weights, its forward with CUDA autocast turned off
    clips_in_step = True  # at the config's gradient_clipping (loop.grad_clip_norm), inside engine.step()
    owns_loss_scaler = True  # the config's fp16 section: the engine scales the loss and skips overflowed steps

    def setup(self) -> None:
        _prepare_environment(self.device)
        # DeepSpeed reads its local rank from the environment; MPICH, Slurm or a single process set none.
        os.environ.setdefault("LOCAL_RANK", str(self.world.local_rank))
        # before any group exists: deepspeed.comm's barrier takes group=GroupMember.WORLD as a default, evaluated
        # at import, which would hold our group past its destruction (see backend.import_before_group)
        deepspeed = _import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        super().setup()
        self.ensure_process_group()  # one process: DeepSpeed still wants one

        if self.spec.precision == "fp16" and not get_accelerator().is_fp16_supported():
            raise BackendUnavailableError(
                f"precision: fp16 is not supported by DeepSpeed's {get_accelerator().device_name()} accelerator "
                "here (no fp16 kernels on this CPU); use bf16 or fp32, or a GPU")
        if self.device.type == "cpu":
            _skip_shm_op()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        deepspeed.utils.logger.setLevel("WARNING")
        self._saved_step: int | None = None
        self._nvme: Path | None = None  # this job's folder of offloaded files (zero_infinity)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        if self.spec.deepspeed.uses_nvme:  # this job's own folder, checked on every rank; a live job's refuses it
            self._nvme = zero_infinity.prepare(self, sum(p.numel() for p in model.parameters()))
        self.config = deepspeed_config(self.spec, self.world.size, self.device.type == "cuda", self._nvme)
        if self.world.rank == 0:
            out = Path(self.spec.output)
            out.mkdir(parents=True, exist_ok=True)
            (out / CONFIG_FILE).write_text(jsonfiles.dumps(self.config, indent=2, sort_keys=True) + "\n")
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        engine.set_gradient_accumulation_boundary(True)
        self.engine = engine
        self._share_fp32_partitions()
        return engine, ds_optimizer

    def _share_fp32_partitions(self) -> None:
        """fp32 training without offload: ZeRO keeps its "fp32 master" partition as a copy of the model's
        own fp32 partition (4Ψ/N bytes the ZeRO formula does not have); make it share that storage.

        DeepSpeed updates the master partition, then copies it into the model's (now a copy onto itself)
        before gathering the partitions; the per-parameter views of the master that its checkpoint and
        ``safe_get_full_*`` helpers read are relinked, as DeepSpeed does after moving the partition
        itself. ZeRO-3 means to share them when dtype and device match, but builds the master from a
        buffer it then replaces (0.19.8), so it is relinked here too.
        """
        optimizer = self.engine.optimizer
        ds = self.spec.deepspeed
        if self.spec.precision != "fp32" or ds.offload_optimizer or ds.offload_param \
                or getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
            return  # with offload the partitions live on other devices or in buffers DeepSpeed moves
        if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2: this rank's slice of each group
            pairs = [(master, own[dist.get_rank(group=group)]) for master, own, group in zip(
                optimizer.single_partition_of_fp32_groups, getattr(optimizer, "parallel_partitioned_bit16_groups", []),
                getattr(optimizer, "real_dp_process_group", []))]
        else:  # ZeRO-3: one flat partition per sub-group
            pairs = list(zip(getattr(optimizer, "fp32_partitioned_groups_flat", []),
                             getattr(optimizer, "fp16_partitioned_groups_flat", [])))
        shared = False
        for master, own in pairs:
            if master.untyped_storage().data_ptr() != own.untyped_storage().data_ptr() \
                    and (master.dtype, master.device, master.shape) == (own.dtype, own.device, own.shape) \
                    and torch.equal(master, own):
                master.data = own.data
                shared = True
        if shared and hasattr(optimizer, "_link_all_hp_params"):
            optimizer._link_all_hp_params()  # the per-parameter views of the master (as DeepSpeed does on reload)

    def teardown(self) -> None:
        """The engine first (its hooks, buffers and optimizer), then the groups through ``deepspeed.comm``, which
        also forgets those ``deepspeed.utils.groups`` keeps: held there, they would outlive the job."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.destroy()
        if getattr(self, "_nvme", None) is not None:  # this rank's offloaded files, also after a failure
            zero_infinity.remove(self._nvme, self.world.rank)
        ended = []
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            import deepspeed.comm

            ended = live_groups()
            deepspeed.comm.destroy_process_group()
            self._owns_group = False
        super().teardown()
        let_go_of(ended)  # a script's engine, its optimizer and its parameters hold the groups no more

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """DeepSpeed's own ``engine.compile``: the engine's module, in place, with ZeRO's hooks kept eager."""
        self.engine.compile(compile_kwargs={"mode": mode})

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Not the accumulation boundary: ZeRO-0/1 keep gradients local, ZeRO-2/3 keep accumulating shards."""
        model.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            model.set_gradient_accumulation_boundary(True)

    def backward(self, loss: torch.Tensor) -> None:
        with zero_infinity.failures_named(self.spec, self._nvme, self.world.rank):
            self.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float | None:
        """Not asked (``clips_in_step``): DeepSpeed clips inside ``engine.step()``; no norm to report."""
        return None

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any = None) -> bool:
        """``engine.step()`` (``step`` is never given: the engine owns its loss scaler)."""
        with zero_infinity.failures_named(self.spec, self._nvme, self.world.rank):
            self.engine.step()
        zero_infinity.check_room(self.spec, self._nvme)  # a drive that filled up may have cut writes short
        return bool(self.engine.was_step_applied())  # False: fp16 overflow, DeepSpeed skipped the update

    def grads_finite(self, model: nn.Module) -> bool:
        """Checks the gradients where ZeRO keeps them (this rank's reduced partitions, or ``.grad`` at
        stage 0); one all-reduce gives every rank the same answer."""
        held = getattr(self.engine.optimizer, "averaged_gradients", None) or {}
        partitions = [t for group in (held.values() if isinstance(held, dict) else held) if group
                      for t in (group if isinstance(group, list) else [group]) if torch.is_tensor(t)]
        grads = partitions + [p.grad for p in self.unwrap(model).parameters() if p.grad is not None]
        bad = float(not all_finite(grads))
        return self.all_reduce(np.array([bad]), op="max")[0] == 0.0

    def loss_scale(self) -> float | None:
        if self.spec.precision != "fp16":
            return None
        return float(getattr(self.engine.optimizer, "cur_scale", math.nan))

    # ---------------------------------------------------------------- full (consolidated) state
    def _hp_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.unwrap(self.engine).named_parameters()

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The fp32 weights (ZeRO's master copy, gathered on every rank); collective."""
        from deepspeed.utils import safe_get_full_fp32_param

        if self.spec.deepspeed.save_checkpoint:
            self._save_native_checkpoint()
        gathered: dict[int, torch.Tensor] = {}
        out = {}
        for name, value in self.unwrap(model).state_dict(keep_vars=True).items():
            if not isinstance(value, nn.Parameter):
                out[name] = value.detach().cpu()
                continue
            if id(value) not in gathered:  # tied weights: one gather, two names
                full = safe_get_full_fp32_param(value)  # None: no ZeRO, no low-precision copy
                gathered[id(value)] = (value if full is None else full).detach().float().cpu()
            out[name] = gathered[id(value)]
        return out

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.unwrap(model)
        for name, param in module.named_parameters():
            value = state[name].to(self.device, torch.float32)
            with self._gathered(param):
                param.data.copy_(value.to(param.dtype))
            safe_set_full_fp32_param(param, value)
        for name, buffer in module.named_buffers():
            if name in state:
                buffer.data.copy_(state[name].to(buffer.device, buffer.dtype))

    def _gathered(self, param: nn.Parameter) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-3: the whole parameter for the block, re-partitioned after (rank 0's values kept)."""
        if not hasattr(param, "ds_id"):
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=0)

    def _optimizer_slots(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The inner torch optimizer's per-parameter slots (e.g. exp_avg) and its scalar ones (e.g. step)."""
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        for slots in inner.state.values():
            tensors = [k for k, v in slots.items() if torch.is_tensor(v) and v.ndim > 0]
            scalars = {k: torch.as_tensor(v).detach().cpu() for k, v in slots.items() if k not in tensors}
            return tensors, scalars
        return [], {}

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """``<parameter name>/<slot>`` → full fp32 tensor, gathered from the ZeRO partitions; collective."""
        from deepspeed.utils import safe_get_full_optimizer_state

        if self.engine.zero_optimization_stage() == 0 and self.spec.precision == "fp32":
            return super().full_optimizer_state(self.unwrap(model), optimizer)
        tensors, scalars = self._optimizer_slots()
        out = {}
        for name, param in self._hp_params():
            for slot in tensors:
                out[f"{name}/{slot}"] = safe_get_full_optimizer_state(param, slot).detach().cpu()
            for slot, value in scalars.items():
                out[f"{name}/{slot}"] = value.clone()
        return out

    def load_full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, torch.Tensor]) -> None:
        """Scatter ``<parameter name>/<slot>`` full tensors into ZeRO's partitions (every rank calls this)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        from polytrain.checkpoint.store import CheckpointError

        if not state:
            return
        if self.engine.zero_optimization_stage() == 0 and self.spec.precision == "fp32":
            return super().load_full_optimizer_state(self.unwrap(model), optimizer, state)
        params = dict(self._hp_params())
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            name, _, slot = key.rpartition("/")
            if name not in params:
                raise CheckpointError(f"checkpoint: optimizer state for unknown parameter {name!r}")
            slots.setdefault(name, {})[slot] = value
        # Per-parameter slots have a parameter's shape somewhere; the others (Adam's step) are one number.
        tensor_slots = {slot for per_param in slots.values() for slot, v in per_param.items() if v.numel() > 1}
        scalars = {slot: v.reshape(()) for slot, v in next(iter(slots.values())).items() if slot not in tensor_slots}
        self._materialize_optimizer_state(sorted(tensor_slots), scalars)
        for name, param in params.items():
            for slot, value in slots.get(name, {}).items():
                if slot in tensor_slots:
                    safe_set_full_optimizer_state(param, value.to(self.device, torch.float32), slot)

    def _materialize_optimizer_state(self, tensor_slots: list[str], scalars: dict[str, torch.Tensor]) -> None:
        """Give the inner torch optimizer its state before its first step (DeepSpeed creates it lazily),
        then let ZeRO link each parameter's fragment of it; scalar slots (Adam's step) are set here."""
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        fresh = not inner.state
        # ZeRO-3 puts its flat fp32 partitions into the optimizer's param groups only while it steps.
        flats = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", None)
        if flats is None:
            flats = [flat for group in inner.param_groups for flat in group["params"]]
        for index, flat in enumerate(flats):
            with zero_infinity.swapped_in(self.engine.optimizer, index):  # nvme: the partition and its state here
                slots = inner.state[flat]
                for slot in tensor_slots:
                    if fresh or slot not in slots:
                        slots[slot] = torch.zeros_like(flat)
                for slot, value in scalars.items():
                    slots[slot] = value.clone()
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if fresh and link is not None:  # ZeRO-1/2 and the bf16 optimizer: point the fragments at the new state
            link()

    def _save_native_checkpoint(self) -> None:
        """DeepSpeed's own checkpoint (collective), convertible with `polytrain.checkpoint.export`."""
        step = int(self.engine.global_steps)
        if self._saved_step == step:
            return
        self.engine.save_checkpoint(str(Path(self.spec.output) / CHECKPOINT_DIR))
        self._saved_step = step

"""The option tables of backends that have options (``fsdp:``, ``deepspeed:``, ``horovod:`` in a spec).

Each table is a frozen dataclass named in its backend's registry row (``BackendEntry.options``); the
spec holds it in a field named like the backend. Its ``check(spec)`` holds the rules that involve
other fields of the spec; the rule that a non-default table needs its backend is the spec's own,
for every row with options alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import SpecError
from polytrain.spec.schema import rule

FSDP_SHARDING = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")


@dataclass(frozen=True)
class FSDPSpec:
    """Options of backend ``fsdp`` (FSDP2 ``fully_shard``)."""

    sharding: str = rule("full_shard", choices=FSDP_SHARDING)
    # Module classes (class name or module.QualName) sharded as units; null: the blocks the model declares.
    units: tuple[str, ...] | None = None
    activation_checkpointing: bool = False  # an alias of the top-level activation_checkpointing (same units)
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory
    reduce_fp32: bool = True  # with precision bf16/fp16: reduce gradients in fp32 (else in the compute dtype)

    def check(self, spec: Any) -> None:  # the whole TrainSpec (which holds this table)
        if self.units is not None and any(not name.strip() for name in self.units):
            raise SpecError("fsdp.units: class names must not be blank")


OFFLOAD_CHOICES = (False, True, "cpu", "nvme")


@dataclass(frozen=True)
class AioSpec:
    """DeepSpeed's ``aio`` table (its names and defaults): how the nvme offloads read and write their files."""

    block_size: int = rule(1048576, min=4096)  # bytes per I/O request
    queue_depth: int = rule(8, min=1)  # requests in flight
    intra_op_parallelism: int = rule(1, min=1)  # threads splitting one read or write
    single_submit: bool = False  # submit requests one by one (else in batches)
    overlap_events: bool = True  # submit new requests while earlier ones complete


@dataclass(frozen=True)
class DeepSpeedSpec:
    """Options of backend ``deepspeed``; ``config`` overrides any key of the generated DeepSpeed config."""

    stage: int = rule(2, choices=(0, 1, 2, 3))  # ZeRO stage
    # where the optimizer state and step go: false (the device), true or cpu (host memory, ZeRO-Offload,
    # stage >= 1), nvme (files under nvme_path, ZeRO-Infinity, stage 3)
    offload_optimizer: bool | str = rule(False, choices=OFFLOAD_CHOICES)
    # where partitioned parameters rest between uses: false, true or cpu (host memory), nvme; stage 3 only
    offload_param: bool | str = rule(False, choices=OFFLOAD_CHOICES)
    nvme_path: str | None = None  # the directory (a local NVMe drive) the nvme offloads write to
    aio: AioSpec = field(default_factory=lambda: AioSpec())  # DeepSpeed's async I/O settings for the nvme offloads
    save_checkpoint: bool = False  # also write DeepSpeed's own checkpoint to <output>/deepspeed_checkpoint
    config: Mapping[str, Any] = field(default_factory=dict)  # merged key by key over the generated config

    @property
    def optimizer_device(self) -> str:
        """Where the optimizer state is offloaded: "" (nowhere), "cpu" or "nvme"."""
        return offload_device(self.offload_optimizer)

    @property
    def param_device(self) -> str:
        """Where partitioned parameters are offloaded: "" (nowhere), "cpu" or "nvme"."""
        return offload_device(self.offload_param)

    @property
    def uses_nvme(self) -> bool:
        """Whether anything is offloaded to the drive under ``nvme_path`` (ZeRO-Infinity)."""
        return "nvme" in (self.optimizer_device, self.param_device)

    def check(self, spec: Any) -> None:  # the whole TrainSpec (which holds this table)
        self._check_nvme()
        if self.offload_param and self.stage != 3:
            raise SpecError(f"deepspeed.offload_param: needs deepspeed.stage 3, not {self.stage}")
        if spec.backend == "deepspeed" and self.stage > 0 and spec.reliability.on_nonfinite == "skip":
            raise SpecError("reliability.on_nonfinite: 'skip' needs deepspeed.stage 0 on backend deepspeed (ZeRO "
                            "keeps partitioned gradients that cannot be dropped without a step); use 'stop'")
        if self.offload_optimizer and self.stage == 0:
            raise SpecError("deepspeed.offload_optimizer: needs deepspeed.stage 1, 2 or 3, not 0")
        for key in ("optimizer", "scheduler"):
            if key in self.config:
                raise SpecError(f"deepspeed.config.{key}: not allowed; polytrain passes its own {key} "
                                f"(set it with the spec's {'optimizer' if key == 'optimizer' else 'schedule'} table)")
        clip = float(spec.loop.grad_clip_norm or 0.0)
        owned = {("zero_optimization", "stage"): ("deepspeed.stage", self.stage),
                 ("gradient_accumulation_steps",): ("loop.grad_accum_steps", spec.loop.grad_accum_steps),
                 ("gradient_clipping",): ("loop.grad_clip_norm", clip),
                 ("bf16", "enabled"): ("precision", spec.precision == "bf16"),
                 ("fp16", "enabled"): ("precision", spec.precision == "fp16")}
        for path, (field_name, expected) in owned.items():
            check_owned(self.config, path, field_name, expected)
        for key, flag in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            zero = self.config.get("zero_optimization")
            if isinstance(zero, Mapping) and key in zero and not flag:
                raise SpecError(f"deepspeed.config.zero_optimization.{key}: set deepspeed.{key}: true instead (the "
                                f"spec owns whether it is on; deepspeed.config may then tune its other keys)")

    def _check_nvme(self) -> None:
        nvme = [key for key in ("offload_optimizer", "offload_param") if getattr(self, key) == "nvme"]
        if nvme and self.stage != 3:
            raise SpecError(f"deepspeed.{nvme[0]}: nvme needs deepspeed.stage 3, not {self.stage} (ZeRO-Infinity); "
                            "stages 1 and 2 offload to cpu only")
        if nvme and not self.nvme_path:
            raise SpecError(f"deepspeed.nvme_path: required with deepspeed.{nvme[0]}: nvme (a directory on the "
                            "drive the offloaded tensors are written to)")
        if not nvme and self.nvme_path:
            raise SpecError("deepspeed.nvme_path: only used with deepspeed.offload_optimizer or offload_param: nvme")
        if not nvme and self.aio != AioSpec():
            raise SpecError("deepspeed.aio: only used with deepspeed.offload_optimizer or offload_param: nvme")
        if "aio" in self.config:
            raise SpecError("deepspeed.config.aio: set deepspeed.aio instead (the spec owns DeepSpeed's aio table)")
        for key in ("offload_optimizer", "offload_param"):
            device = offload_device(getattr(self, key))
            if device:
                check_owned(self.config, ("zero_optimization", key, "device"), f"deepspeed.{key}", device)
                check_owned(self.config, ("zero_optimization", key, "nvme_path"), "deepspeed.nvme_path",
                            self.nvme_path)


def offload_device(value: bool | str) -> str:
    """An offload field's device: "" (off), "cpu" (true or cpu) or "nvme"."""
    return "cpu" if value is True else (value or "")


def check_owned(config: Mapping[str, Any], path: tuple[str, ...], field_name: str, expected: Any) -> None:
    """A key of the DeepSpeed config that the spec owns may be repeated in ``deepspeed.config`` only with the
    value the spec gives it; anything else would change the run behind the spec's checks."""
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return
        node = node[key]
    if isinstance(expected, bool):
        same = node is expected
    elif expected is None or isinstance(expected, str):
        same = node == expected
    else:
        same = not isinstance(node, bool) and isinstance(node, (int, float)) and node == expected
    if not same:
        raise SpecError(f"deepspeed.config.{'.'.join(path)}: {node!r} disagrees with {field_name} ({expected!r}); "
                        f"the spec owns it: set {field_name} instead")


@dataclass(frozen=True)
class HorovodSpec:
    """Options of backend ``horovod`` (PyTorch and TensorFlow)."""

    compression: str = rule("none", choices=("none", "fp16"))  # fp16: gradients travel as float16

    def check(self, spec: Any) -> None:  # the whole TrainSpec (which holds this table)
        pass

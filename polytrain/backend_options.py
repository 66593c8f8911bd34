"""The option tables of backends that have options (``fsdp:``, ``deepspeed:``, ``horovod:`` in a spec).

Each table is a frozen dataclass named in its backend's registry row (``BackendEntry.options``); the
spec holds it in a field named like the backend. Its ``check(spec)`` holds the rules that involve
other fields of the spec; the rule that a non-default table needs its backend is the spec's own,
for every row with options alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polytrain.errors import SpecError
from polytrain.schema import rule

if TYPE_CHECKING:
    from polytrain.spec import TrainSpec

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

    def check(self, spec: TrainSpec) -> None:
        if self.units is not None and any(not name.strip() for name in self.units):
            raise SpecError("fsdp.units: class names must not be blank")


@dataclass(frozen=True)
class DeepSpeedSpec:
    """Options of backend ``deepspeed``; ``config`` overrides any key of the generated DeepSpeed config."""

    stage: int = rule(2, choices=(0, 1, 2, 3))  # ZeRO stage
    offload_optimizer: bool = False  # optimizer state and step on the CPU (ZeRO-Offload, stage >= 1)
    offload_param: bool = False  # parameters in CPU memory (ZeRO-Infinity, stage 3)
    save_checkpoint: bool = False  # also write DeepSpeed's own checkpoint to <output>/deepspeed_checkpoint
    config: Mapping[str, Any] = field(default_factory=dict)  # merged key by key over the generated config

    def check(self, spec: TrainSpec) -> None:
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


def check_owned(config: Mapping[str, Any], path: tuple[str, ...], field_name: str, expected: Any) -> None:
    """A key of the DeepSpeed config that the spec owns may be repeated in ``deepspeed.config`` only with the
    value the spec gives it; anything else would change the run behind the spec's checks."""
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return
        node = node[key]
    same = (node is expected) if isinstance(expected, bool) else (
        not isinstance(node, bool) and isinstance(node, (int, float)) and node == expected)
    if not same:
        raise SpecError(f"deepspeed.config.{'.'.join(path)}: {node!r} disagrees with {field_name} ({expected!r}); "
                        f"the spec owns it: set {field_name} instead")


@dataclass(frozen=True)
class HorovodSpec:
    """Options of backend ``horovod`` (PyTorch and TensorFlow)."""

    compression: str = rule("none", choices=("none", "fp16"))  # fp16: gradients travel as float16

    def check(self, spec: TrainSpec) -> None:
        pass

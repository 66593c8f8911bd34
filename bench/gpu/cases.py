"""What the GPU check runs: the backends, the training runs on each, and the model sizes per mode.

Modes: ``full`` (the GPU check), ``quick`` (fewer epochs and small models: a smoke run of every path;
accuracy is then held to the CPU run of the same length, with no floor). ``--device cpu`` runs the
same cases on the CPU (a dry run of the code paths).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DIGITS_SPEC = REPO / "examples" / "digits.yaml"

#: the injected non-finite loss: the training loss of this update (1-based) is multiplied by inf
INJECT_AT = 20
#: accuracy may fall this far below the CPU run (fp32 / bf16 and fp16)
SLACK_FP32, SLACK_LOW = 0.02, 0.03
#: full mode: what each workload must reach whatever the CPU run did (README: digits ≥ 0.95)
FLOORS = {"digits": 0.95, "tokens": 0.7}
#: the tokens workload of tests/multiproc/test_workloads.py (reaches ~0.8 on CPU)
TOKENS = {"samples": 1024, "seq_len": 16, "vocab": 16}
LM_SMALL = {"d_model": 32, "n_heads": 4, "n_layers": 2}


@dataclass(frozen=True)
class BackendCase:
    """One backend configuration: spec settings, processes on the one device, who starts the process
    group (``None``: polytrain itself; ``nccl``/``gloo``: the check, before the Trainer runs)."""

    key: str
    label: str
    spec: dict[str, Any]
    nproc: int = 1
    process_group: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    needs: str | None = None  # a module that must import (else the rows are skipped)
    #: a failure whose message holds one of these is a refusal (INFO), not a failed check
    refusals: tuple[str, ...] = ()
    #: whether ``reliability.on_nonfinite: skip`` is allowed (polytrain's ZeRO stages only stop)
    nonfinite_skip: bool = True


def backend_cases(device: str) -> dict[str, BackendCase]:
    """Every backend configuration the correctness and precision sections run, in order."""
    group = "nccl" if device == "cuda" else "gloo"
    cases = [
        BackendCase("local", "local", {"backend": "local"}),
        # polytrain's ddp starts no process group for one process: the check starts one (NCCL on a GPU)
        BackendCase("ddp", f"ddp ×1 ({group})", {"backend": "ddp"}, process_group=group),
        # 2 ranks on the one device through polytrain's own rendezvous (NCCL on a GPU, which may refuse
        # two ranks on one device), then through gloo's CUDA support
        BackendCase("ddp2", f"ddp ×2 ({group}, one device)", {"backend": "ddp"}, nproc=2,
                    refusals=("Duplicate GPU", "duplicate GPU", "same CUDA device", "invalid usage")),
        BackendCase("ddp2-gloo", "ddp ×2 (gloo, one device)", {"backend": "ddp"}, nproc=2,
                    process_group="gloo"),
        BackendCase("fsdp", "fsdp ×1", {"backend": "fsdp"}),
        # the check starts the group: DeepSpeed keeps ZeRO-3's groups across runs in one process
        *(BackendCase(f"zero{stage}", f"deepspeed ZeRO-{stage}",
                      {"backend": "deepspeed", "deepspeed": {"stage": stage}},
                      process_group=group, needs="deepspeed", nonfinite_skip=False) for stage in (1, 2, 3)),
        BackendCase("horovod", "horovod (shim)", {"backend": "horovod"},
                    env={"POLYTRAIN_HOROVOD_IMPL": "shim"}),
    ]
    if device == "cpu":  # on the CPU polytrain's own 2-rank group is gloo already
        cases = [c for c in cases if c.key != "ddp2-gloo"]
    return {c.key: c for c in cases}


def _digits(epochs: int | None) -> dict[str, Any]:
    import yaml

    raw = yaml.safe_load(DIGITS_SPEC.read_text())
    raw.pop("backend", None)
    # the same math at any world size: 32 samples a step, lr not scaled (= digits.yaml on one process)
    raw["data"] = {**raw["data"], "global_batch_size": raw["data"].pop("batch_size")}
    raw["schedule"] = {**raw["schedule"], "lr_scaling": "none"}
    if epochs is not None:
        raw["loop"] = {**raw["loop"], "epochs": epochs}
        raw["schedule"]["warmup_epochs"] = min(raw["schedule"]["warmup_epochs"], epochs)
    return raw


def _tokens(epochs: int) -> dict[str, Any]:
    return {"seed": 0, "model": {"name": "transformer", "params": dict(LM_SMALL)},
            "optimizer": {"name": "adam", "lr": 0.01},
            "data": {"name": "tokens", "global_batch_size": 64, "tokens": dict(TOKENS)},
            "loop": {"epochs": epochs}}


@dataclass(frozen=True)
class Run:
    """One training run in a backend's worker: a spec (without backend or output) and what it checks."""

    name: str  # e.g. "digits fp32"
    section: str  # correctness | precision
    workload: str  # digits | tokens
    precision: str
    raw: dict[str, Any]
    inject_at: int | None = None  # update whose loss is made inf (on the last rank)
    note: str = ""


def without_skip(run: Run) -> Run:
    """``run`` for a backend that cannot skip a non-finite step: bf16 without the injected inf."""
    if run.precision == "fp16" or run.inject_at is None:
        return run
    raw = copy.deepcopy(run.raw)
    raw.pop("reliability", None)
    note = "no inf injected: reliability.on_nonfinite 'skip' needs deepspeed.stage 0"
    return dataclasses.replace(run, raw=raw, inject_at=None, note=note)


def runs(mode: str, sections: tuple[str, ...]) -> list[Run]:
    """The training runs of each backend's worker for the chosen sections."""
    digits_epochs, token_epochs = (None, 14) if mode == "full" else (3, 4)
    out = []
    if "correctness" in sections:
        out += [Run("digits fp32", "correctness", "digits", "fp32", _digits(digits_epochs)),
                Run("tokens fp32", "correctness", "tokens", "fp32", _tokens(token_epochs))]
    if "precision" in sections:
        bf16 = _digits(digits_epochs)
        bf16["reliability"] = {"on_nonfinite": "skip"}
        fp16 = _digits(digits_epochs)
        out += [Run("digits bf16", "precision", "digits", "bf16", bf16, inject_at=INJECT_AT),
                Run("digits fp16", "precision", "digits", "fp16", fp16, inject_at=INJECT_AT),
                Run("tokens bf16", "precision", "tokens", "bf16", _tokens(token_epochs))]
    for run in out:
        run.raw["precision"] = run.precision
        if run.inject_at is not None:
            run.raw["loop"]["log_every_n_steps"] = 1  # a step record for every update
    return out


def run_spec(run: Run, backend: BackendCase, output: str) -> dict[str, Any]:
    """The full spec of ``run`` on ``backend``, writing under ``output``."""
    raw = copy.deepcopy(run.raw)
    raw.update(copy.deepcopy(backend.spec))
    raw["output"] = output
    return raw


# ---------------------------------------------------------------- memory and speed models
#: memory: the CPU bench's transformer (d 512, 3 layers, vocab 2048, 10.5 M) scaled to ~160 M parameters
MEMORY_MODEL = {"full": ({"d_model": 1024, "n_heads": 16, "n_layers": 12}, 8192, 256, 4),
                "quick": ({"d_model": 128, "n_heads": 4, "n_layers": 2}, 512, 32, 4)}


@dataclass(frozen=True)
class MemoryCase:
    """One memory row: the formula's name, spec settings, processes, the process group the check
    starts (``auto``: NCCL on a GPU, gloo on the CPU; None: polytrain's own) and the ``--backends`` key
    that selects it."""

    formula: str
    label: str
    settings: dict[str, Any]
    nproc: int
    process_group: str | None
    backend: str
    #: a failure whose message holds one of these is gloo declining CUDA tensors (INFO, not a failure)
    refusals: tuple[str, ...] = ()


_FULL_SHARD = {"backend": "fsdp", "fsdp": {"sharding": "full_shard"}}
_GLOO_REFUSALS = ("not supported", "unsupported", "Unsupported", "only supports CPU", "ProcessGroupGloo")
MEMORY_CASES: tuple[MemoryCase, ...] = (
    MemoryCase("ddp", "ddp ×1", {"backend": "ddp"}, 1, "auto", "ddp"),
    MemoryCase("fsdp", "fsdp full_shard ×1", _FULL_SHARD, 1, None, "fsdp"),
    MemoryCase("zero1", "ZeRO-1 ×1", {"backend": "deepspeed", "deepspeed": {"stage": 1}}, 1, None, "zero1"),
    MemoryCase("zero2", "ZeRO-2 ×1", {"backend": "deepspeed", "deepspeed": {"stage": 2}}, 1, None, "zero2"),
    MemoryCase("zero3", "ZeRO-3 ×1", {"backend": "deepspeed", "deepspeed": {
        "stage": 3, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}},
        1, None, "zero3"),
    MemoryCase("ddp", "ddp ×2 (gloo, one device)", {"backend": "ddp"}, 2, "gloo", "ddp2", _GLOO_REFUSALS),
    MemoryCase("fsdp", "fsdp full_shard ×2 (gloo, one device)", _FULL_SHARD, 2, "gloo", "fsdp",
               _GLOO_REFUSALS),
)


def memory_spec(settings: dict[str, Any], mode: str, output: str) -> dict[str, Any]:
    params, vocab, seq, batch = MEMORY_MODEL[mode]
    return {**copy.deepcopy(settings), "output": output, "seed": 0, "optimizer": {"name": "adam", "lr": 1e-3},
            "model": {"name": "transformer", "params": dict(params)},
            "data": {"name": "tokens", "batch_size": batch,
                     "tokens": {"vocab": vocab, "seq_len": seq, "samples": 64}}}


@dataclass(frozen=True)
class SpeedConfig:
    """The speed section's model, data, batch and optimizer (the same for every runner)."""

    d_model: int
    n_heads: int
    n_layers: int
    vocab: int
    seq_len: int
    batch: int
    warmup_steps: int
    steps: int  # measured, after the warm-up
    window: int  # steps between time marks
    lr: float = 3e-4

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def spec(self, output: str, precision: str = "bf16", compiled: bool = False) -> dict[str, Any]:
        samples = (self.total_steps + 4) * self.batch  # one epoch holds every step: no evaluation mid-run
        tokens = {"samples": int(samples / 0.98) + 1, "seq_len": self.seq_len, "vocab": self.vocab}
        return {"backend": "local", "seed": 0, "precision": precision, "output": output,
                "model": {"name": "transformer", "params": {"d_model": self.d_model, "n_heads": self.n_heads,
                                                            "n_layers": self.n_layers}},
                "optimizer": {"name": "adamw", "lr": self.lr},
                "data": {"name": "tokens", "batch_size": self.batch, "val_fraction": 0.02,
                         "tokens": tokens},
                "loop": {"epochs": 1, "max_steps": self.total_steps, "log_every_n_steps": self.window},
                "compile": {"enabled": compiled}}


#: full: ~131 M parameters (10 blocks of d 1024 and a 4096-token head) on 16 × 1024 tokens a step
SPEED = {"full": SpeedConfig(1024, 16, 10, 4096, 1024, 16, warmup_steps=10, steps=40, window=10),
         "quick": SpeedConfig(64, 4, 2, 64, 32, 8, warmup_steps=4, steps=8, window=4)}

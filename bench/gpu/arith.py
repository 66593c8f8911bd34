"""The GPU check's arithmetic and verdicts, as pure functions of numbers (tested on CPU).

- memory: the ZeRO paper's bytes per parameter for fp32 Adam (4Ψ parameters + 4Ψ gradients + 8Ψ
  moments = 16Ψ), per rank of N: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 and FSDP
  full_shard 16Ψ/N; DeepSpeed's fp32 master copy of a rank's partition adds 4Ψ/N where it keeps one
  (the same numbers as ``bench/sharded_memory.py``'s ``formula`` — `polytrain.plan.memory.zero_paper_bytes` —
  and ``MASTER``);
- speed: training FLOPs of the zoo's transformer per token, 6 × (matrix-multiply parameters) + 12 ×
  layers × d_model × sequence length for attention (PaLM's convention, causal masking not discounted),
  and model FLOP utilisation against the GPU's dense bf16 peak;
- verdicts: accuracy against the CPU run, a measured size against its formula, a step time against a
  reference step time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"

#: fp32 Adam: bytes per parameter held by one rank of ``n`` (the ZeRO paper's K = 12 for the optimizer)
MEMORY_BACKENDS = ("ddp", "zero1", "zero2", "zero3", "fsdp")
#: DeepSpeed's fp32 copy of its partition, bytes per parameter / N, where it keeps one
MASTER_COPY = {"zero1": 4.0, "zero2": 4.0, "zero3": 4.0}

#: dense bf16 tensor-core peak, TFLOP/s, by a marker in ``torch.cuda.get_device_name()`` (first match wins)
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),  # the H100 SXM's compute with more memory
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # H100 SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
)


def bytes_per_param(backend: str, n: int) -> float:
    """Model-state bytes per parameter on one rank of ``n`` for fp32 Adam (no master copy)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    table = {"ddp": 16.0, "zero1": 8.0 + 8.0 / n, "zero2": 4.0 + 12.0 / n, "zero3": 16.0 / n,
             "fsdp": 16.0 / n}
    if backend not in table:
        raise ValueError(f"no formula for {backend!r} (known: {', '.join(MEMORY_BACKENDS)})")
    return table[backend]


def model_state_bytes(backend: str, n: int, psi: int, master: bool = False) -> float:
    """Bytes of parameters, gradients and Adam state one rank holds; ``master`` adds DeepSpeed's copy."""
    extra = MASTER_COPY.get(backend, 0.0) / n if master else 0.0
    return (bytes_per_param(backend, n) + extra) * psi


def transformer_matmul_params(vocab: int, d_model: int, n_layers: int, d_ff: int | None = None) -> int:
    """Weights that take part in a matrix product per token: each block's qkv, proj, fc and out, plus
    the head over the vocabulary (tied or not); embeddings, norms and biases excluded."""
    d_ff = d_ff or 4 * d_model
    per_layer = 3 * d_model * d_model + d_model * d_model + 2 * d_model * d_ff
    return n_layers * per_layer + vocab * d_model


def train_flops_per_token(matmul_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6N for the weights, 12·L·d·T for attention scores and values."""
    return 6.0 * matmul_params + 12.0 * n_layers * d_model * seq_len


def mfu(samples_per_s: float, seq_len: int, flops_per_token: float,
        peak_tflops: float | None) -> float | None:
    """Model FLOP utilisation: achieved training FLOP/s over the peak (None when the peak is unknown)."""
    if not peak_tflops or peak_tflops <= 0 or samples_per_s <= 0:
        return None
    return samples_per_s * seq_len * flops_per_token / (peak_tflops * 1e12)


def peak_bf16_tflops(device_name: str, override: float | None = None) -> float | None:
    """The dense bf16 peak of a GPU by its name (``override`` wins); None when the name is not known."""
    if override is not None:
        return override
    upper = device_name.upper()
    for marker, tflops in BF16_PEAK_TFLOPS:
        if marker in upper:
            return tflops
    return None


def accuracy_verdict(accuracy: float | None, reference: float | None, slack: float,
                     floor: float | None = None) -> tuple[str, str]:
    """PASS when ``accuracy`` ≥ ``reference`` − ``slack`` (and ≥ ``floor`` when given); with the rule."""
    if accuracy is None or math.isnan(accuracy):
        return FAIL, "no accuracy"
    needed = [] if reference is None else [reference - slack]
    if floor is not None:
        needed.append(floor)
    if not needed:
        return INFO, "no reference"
    bar = max(needed)
    rule = f"≥ {bar:.4f}"
    if reference is not None:
        rule += f" (CPU {reference:.4f} − {slack:g}" + ("" if floor is None else f", floor {floor:g}") + ")"
    return (PASS if accuracy >= bar - 1e-12 else FAIL), rule


def ratio_verdict(measured: float, expected: float, low: float, high: float) -> tuple[str, float]:
    """PASS when ``measured / expected`` lies in [low, high]; returns the verdict and the ratio."""
    if expected <= 0:
        return FAIL, float("nan")
    ratio = measured / expected
    return (PASS if low <= ratio <= high else FAIL), ratio


def speed_verdict(step_s: float, reference_step_s: float, target: float) -> tuple[str, float]:
    """PASS when ``step_s`` ≤ ``target`` × the reference's step time; returns the verdict and the ratio."""
    if reference_step_s <= 0 or step_s <= 0:
        return FAIL, float("nan")
    ratio = step_s / reference_step_s
    return (PASS if ratio <= target else FAIL), ratio


def window_step_times(marks: Sequence[float], steps_per_window: int, warmup_windows: int) -> list[float]:
    """Seconds per step of each window between consecutive time marks, less the first ``warmup_windows``."""
    if steps_per_window < 1:
        raise ValueError("steps_per_window must be >= 1")
    times = [(b - a) / steps_per_window for a, b in zip(marks, marks[1:])]
    return times[warmup_windows:]


def median_step(times: Sequence[float]) -> float:
    """The median of the measured per-step times (NaN when there are none)."""
    return float(statistics.median(times)) if times else float("nan")


def overflow_skipped_at(steps: Sequence[dict], update: int) -> tuple[bool, str]:
    """Whether the fp16 update ``update`` was skipped, from per-step ``metrics.jsonl`` records (logged
    every step): ``skipped_steps`` grows by exactly one there and the loss scale halves."""
    by_step = {int(r["step"]): r for r in steps if "skipped_steps" in r}
    if update not in by_step or update - 1 not in by_step:
        return False, f"no skipped_steps logged at updates {update - 1} and {update}"
    before, at = by_step[update - 1], by_step[update]
    grew = at["skipped_steps"] - before["skipped_steps"]
    halved = math.isclose(at["loss_scale"], before["loss_scale"] / 2)
    text = (f"update {update}: skipped_steps {before['skipped_steps']:g}→{at['skipped_steps']:g}, "
            f"loss scale {before['loss_scale']:g}→{at['loss_scale']:g}")
    return grew == 1 and halved, text

"""Turning the workers' records into the table's rows: the pass/fail rules of each section.

Pure functions of the records (dicts as the workers write them), so the rules are tested with
numbers on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.gpu.arith import (
    FAIL,
    INFO,
    PASS,
    SKIP,
    accuracy_verdict,
    mfu,
    model_state_bytes,
    overflow_skipped_at,
    ratio_verdict,
    speed_verdict,
    train_flops_per_token,
    transformer_matmul_params,
)
from bench.gpu.cases import FLOORS, SLACK_FP32, SLACK_LOW, Run, SpeedConfig
from bench.gpu.report import Row, gib

#: model state (parameters, gradients, Adam state) against its formula; the allocator's peak against it
STATE_BAND = (0.8, 1.1)
PEAK_LIMIT = 2.0
#: polytrain's step time against the hand-written loop's, and against Lightning's and Accelerate's
TARGET_VS_HAND = 1.03
TARGET_VS_OTHERS = 1.01  # "at least as fast", within 1 % of timing noise


def placement_problem(record: Mapping[str, Any], device: str) -> str | None:
    """What is on the wrong device (weights at start and end, optimizer state at the end), or None."""
    for when in ("start", "end"):
        devices = record.get(when, {}).get("param_devices")
        if devices != [device]:
            return f"weights on {devices} at the {when}, expected [{device!r}]"
    state = record.get("end", {}).get("state_devices", [])
    if state and state != [device]:
        return f"optimizer state on {state}, expected [{device!r}]"
    return None


def _placement_text(record: Mapping[str, Any]) -> str:
    end = record.get("end", {})
    dtypes = "/".join(end.get("param_dtypes", []))
    state = ",".join(end.get("state_devices", [])) or "none"
    return f"weights {','.join(end.get('param_devices', []))} {dtypes}, optimizer state {state}"


def _injection(run: Run, record: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the injected infinite loss was dealt with as the precision requires."""
    at = run.inject_at
    if run.precision == "fp16":
        ok, text = overflow_skipped_at(record.get("steps", []), at)
        lines = record.get("overflow_lines", [])
        said = any(f"in update {at} of this run: skipped" in line for line in lines)
        return ok and said, text + ("" if said else "; no 'fp16 gradient overflow' line for it")
    events = [(int(e["step"]), e.get("action")) for e in record.get("nonfinite", [])]
    ok = events == [(at, "skip")]
    return ok, f"non-finite update {at}: {'skipped' if ok else f'events {events}'}"


def train_row(run: Run, label: str, record: Mapping[str, Any] | None, reference: float | None, device: str,
              mode: str, missing: str = "no record", refusals: Sequence[str] = ()) -> Row:
    """One training run of one backend: accuracy against the CPU run, placement, the injected inf."""
    case = f"{label} · {run.name}"
    if record is None:
        return Row(run.section, case, FAIL, "not run", "", missing)
    if "error" in record:
        error = record["error"]
        everything = error + record.get("traceback", "")
        if "BackendUnavailableError" in error:
            return Row(run.section, case, SKIP, "", "", error.partition(": ")[2])
        if any(marker in everything for marker in refusals):
            return Row(run.section, case, INFO, "refused", "", error)
        return Row(run.section, case, FAIL, "error", "", error)
    slack = SLACK_FP32 if run.precision == "fp32" else SLACK_LOW
    floor = FLOORS[run.workload] if mode == "full" else None
    accuracy = record.get("val_accuracy")
    result, rule = accuracy_verdict(accuracy, reference, slack, floor)
    notes = [f"{record.get('seconds', 0):.1f} s", record.get("backend_label", ""), run.note]
    problem = placement_problem(record, device)
    if problem:
        result = FAIL
        notes.insert(0, problem)
    measured = f"val acc {accuracy:.4f}; {_placement_text(record)}" if accuracy is not None else "no accuracy"
    if run.inject_at is not None:
        ok, text = _injection(run, record)
        measured += f"; {text}"
        if not ok:
            result = FAIL
    return Row(run.section, case, result, measured, rule, "; ".join(n for n in notes if n))


def _worst(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def memory_row(key: str, label: str, nproc: int, records: Sequence[Mapping[str, Any]] | None,
               missing: str = "no record", refusals: Sequence[str] = ()) -> Row:
    """Model state and the allocator's peak of one backend (max over ranks) against its formula."""
    if not records:
        return Row("memory", label, FAIL, "not run", "", missing)
    errors = [r for r in records if "error" in r]
    if errors:
        everything = errors[0]["error"] + errors[0].get("traceback", "")
        refused = any(marker in everything for marker in refusals)
        return Row("memory", label, INFO if refused else FAIL, "refused" if refused else "error", "",
                   errors[0]["error"])
    psi = int(records[0]["psi"])
    kinds = ("params", "grads", "optimizer_state", "master_copy")
    state = max(sum(r.get(k, 0) for k in kinds) for r in records)
    formula = model_state_bytes(key, nproc, psi)
    result, ratio = ratio_verdict(state, formula, *STATE_BAND)
    measured = f"state {gib(state)} ({ratio:.3f}×)"
    peak = _worst(records, "peak")
    other = _worst(records, "other") or 0
    if peak is not None:
        peak_ratio = peak / formula
        measured += f", peak {gib(peak)} ({peak_ratio:.2f}×)"
        if peak - other > PEAK_LIMIT * formula or peak < state:  # the backend's own buffers ("other") aside
            result = FAIL
    else:
        measured += ", peak n/a (no CUDA allocator)"
    devices = sorted({d for r in records for d in r.get("param_devices", [])})
    reference = (f"{gib(formula)} = {model_state_bytes(key, nproc, 1):g}Ψ, Ψ = {psi / 1e6:.1f} M, "
                 f"N = {nproc}; state in [{STATE_BAND[0]}, {STATE_BAND[1]}]×")
    if peak is not None:
        reference += f", peak − other ≤ {PEAK_LIMIT}×"
    return Row("memory", label, result, measured, reference,
               f"other {gib(other)}; weights on {','.join(devices)}")


def speed_rows(results: Mapping[str, Mapping[str, Any]], cfg: SpeedConfig, peak_tflops: float | None,
               labels: Mapping[str, str]) -> list[Row]:
    """samples/s and MFU of each runner; polytrain against the hand-written loop (≤ 1.03×) and against
    Lightning and Accelerate (at least as fast)."""
    matmul = transformer_matmul_params(cfg.vocab, cfg.d_model, cfg.n_layers)
    per_token = train_flops_per_token(matmul, cfg.n_layers, cfg.d_model, cfg.seq_len)
    shape = (f"transformer d {cfg.d_model} × {cfg.n_layers} layers, vocab {cfg.vocab}, "
             f"{matmul / 1e6:.0f} M matmul params; bf16; batch {cfg.batch} × {cfg.seq_len} tokens; AdamW")

    def numbers(rec: Mapping[str, Any]) -> str:
        util = mfu(rec["samples_per_s"], cfg.seq_len, per_token, peak_tflops)
        shown = f"MFU {util:.1%}" if util is not None else "MFU n/a (unknown peak: --peak-tflops)"
        return f"{rec['samples_per_s']:.1f} samples/s, {rec['step_s'] * 1e3:.1f} ms/step, {shown}"

    rows: list[Row] = []
    hand, ours = results.get("hand", {}), results.get("polytrain", {})
    for runner, rec in results.items():
        label = labels.get(runner, runner)
        if "skip" in rec:
            rows.append(Row("speed", label, SKIP, "", "", rec["skip"]))
            continue
        if "error" in rec or "step_s" not in rec:
            rows.append(Row("speed", label, FAIL, "error", "", rec.get("error", "no step time")))
            continue
        if runner == "hand":
            peak = f"bf16 peak {peak_tflops:g} TFLOP/s" if peak_tflops else "bf16 peak unknown"
            rows.append(Row("speed", label, INFO, numbers(rec), peak, shape))
        elif runner == "hand-compile":
            eager = f"{hand['step_s'] / rec['step_s']:.2f}× the eager loop's speed" if "step_s" in hand else ""
            rows.append(Row("speed", label, INFO, numbers(rec), eager, "torch.compile, default mode"))
        elif runner in ("polytrain", "polytrain-compile"):
            base = hand if runner == "polytrain" else results.get("hand-compile", {})
            what = "hand-written loop" if runner == "polytrain" else "compiled hand-written loop"
            if "step_s" not in base:
                rows.append(Row("speed", label, INFO, numbers(rec), f"no {what} to compare", ""))
                continue
            result, ratio = speed_verdict(rec["step_s"], base["step_s"], TARGET_VS_HAND)
            rule = f"step time {ratio:.3f}× the {what}'s (target ≤ {TARGET_VS_HAND})"
            rows.append(Row("speed", label, result, numbers(rec), rule, ""))
        else:
            if "step_s" not in ours:
                rows.append(Row("speed", label, INFO, numbers(rec), "no polytrain run to compare", ""))
                continue
            result, ratio = speed_verdict(ours["step_s"], rec["step_s"], TARGET_VS_OTHERS)
            rows.append(Row("speed", f"polytrain vs {label}", result, numbers(rec),
                            f"polytrain's step time {ratio:.3f}× this (target ≤ {TARGET_VS_OTHERS})",
                            f"{label} {rec.get('version', '')}".strip()))
    return rows


def speed_summary(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Every measured runner's samples/s over the hand-written loop's (for the text under the table)."""
    hand = results.get("hand", {}).get("samples_per_s")
    if not hand:
        return {}
    return {runner: rec["samples_per_s"] / hand for runner, rec in results.items() if "samples_per_s" in rec}


__all__ = ["FAIL", "INFO", "PASS", "SKIP", "memory_row", "placement_problem", "speed_rows", "speed_summary",
           "train_row"]

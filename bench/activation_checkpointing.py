"""Activation checkpointing: activation memory and step time, on vs off (one process, backend local).

Run:  python bench/activation_checkpointing.py [--steps N] [--layers L] [--rounds R]

The zoo's transformer LM (d_model 256, 8 heads, 8 blocks, vocab 1024, 256 tokens, 8 sequences a
step), Adam, fp32, through polytrain's framework adapter (`TorchFramework`: forward, backward,
optimizer step), each setting in a fresh process. Three figures per setting:

- saved for backward: the bytes of the tensors autograd keeps from the forward pass for the backward
  pass (``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters not counted) —
  with checkpointing, each block's input instead of everything inside it;
- peak step memory: on CUDA the allocator's peak during a step above the memory held before it; on CPU
  the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) above the
  resident set before the step, with glibc's malloc told to return every block over 64 KiB to the
  system (MALLOC_MMAP_THRESHOLD_), so freed activations leave the resident set. This includes the
  gradients and the recomputed block alive during the backward pass;
- step time: the median after 2 warm-up steps, and its ratio to checkpointing off, measured in a
  process of its own without the hooks or the malloc setting (which makes every large allocation a
  fresh mmap and would charge the run that allocates more).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, BATCH, WARMUP = 1024, 256, 8, 2


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(checkpointing: bool, layers: int, steps: int, measure: str) -> dict[str, float]:
    """``measure``: "memory" (saved tensors and the peak) or "time" (no hooks, malloc as usual)."""
    import torch
    from lm_job import open_lm_job

    from polytrain.world import World

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    job = open_lm_job({"backend": "local", "activation_checkpointing": checkpointing}, prefix="polytrain-ac-",
                      world=World(), lm={"d_model": 256, "n_heads": 8, "n_layers": layers}, vocab=VOCAB, seq=SEQ,
                      batch=BATCH)
    backend, fw = job.backend, job.fw
    model = backend.unwrap(fw.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    cuda = fw.device.type == "cuda"
    times, saved_bytes, peaks = [], [], []
    for step in range(WARMUP + steps):
        x, y = job.tokens()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _resident_kib("VmRSS") * 1024
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if measure == "memory" \
                else contextlib.nullcontext():
            fw.train_micro_step(x, y, 1.0 / BATCH, sync=True)
        fw.optimizer_step(1e-3, None)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() if cuda else _resident_kib("VmHWM") * 1024) - before
        if step >= WARMUP:
            times.append(elapsed)
            saved_bytes.append(sum(saved.values()))
            peaks.append(peak)
    backend.teardown()
    return {"step_s": statistics.median(times), "saved_bytes": statistics.median(saved_bytes),
            "peak_bytes": statistics.median(peaks), "device": fw.device.type}


def run_worker(checkpointing: bool, layers: int, steps: int, measure: str) -> dict[str, float]:
    env = dict(os.environ)
    if measure == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed activations go back to the system
    out = subprocess.run([sys.executable, __file__, "--worker", str(int(checkpointing)), str(layers), str(steps),
                          measure], check=True, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_all(layers: int, steps: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Memory once per setting; time in ``rounds`` rounds of off, on (a fresh process each, alternating so a
    busy spell on a shared machine does not fall on one setting only), the median of the rounds."""
    off, on = (run_worker(flag, layers, steps, "memory") for flag in (False, True))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for flag in (False, True):
            times[flag].append(run_worker(flag, layers, steps, "time")["step_s"])
    off["step_s"], on["step_s"] = statistics.median(times[False]), statistics.median(times[True])
    return off, on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    off, on = measure_all(args.layers, args.steps, args.rounds)
    mib = 1024 * 1024
    print(f"transformer LM d_model 256, {args.layers} blocks, vocab {VOCAB}, {SEQ} tokens × {BATCH} sequences, "
          f"Adam, fp32, {off['device']}, median of {args.steps} steps after {WARMUP} warm-up "
          f"(time: median of {args.rounds} alternating rounds)")
    print(f"{'':26} {'off':>10} {'on':>10} {'on/off':>7}")
    for label, key, scale, unit in (("saved for backward", "saved_bytes", mib, "MiB"),
                                    ("peak step memory", "peak_bytes", mib, "MiB"),
                                    ("step time", "step_s", 1e-3, "ms")):
        print(f"{label + ' (' + unit + ')':26} {off[key] / scale:10.1f} {on[key] / scale:10.1f} "
              f"{on[key] / off[key]:7.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        print(json.dumps(worker(bool(int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
    else:
        main()

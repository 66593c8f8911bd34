"""The GPU check's own-loop section: a hand-written loop on `polytrain.torch.Distributed` on each backend.

The loop (`train_digits`, also run by ``tests/multiproc/own_loop_worker.py``): the digits MLP, SGD with momentum, 2
micro-steps of accumulation, clipping that bites, 20 optimizer steps; each micro-step's global batch of 32
(17 in the last update: an uneven final batch) is split over the ranks, so every world size sees the same
samples per update. Each backend's fp32 losses
are held to the same loop on the CPU (``local``, one process): every micro-step's loss within
``LOSS_TOL``; bf16 and fp16 (CUDA only) within ``LOSS_TOL_LOW`` on average. Weights and momentum must sit on the
device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.gpu.arith import FAIL, INFO, PASS
from bench.gpu.report import Row
from polytrain.world import World

GLOBAL_BATCH, ACCUM, STEPS, CLIP = 32, 2, 20, 0.5
#: the last update's micro-batches: an epoch's short last batch, odd, so the ranks hold different numbers of samples
UNEVEN = 17
#: fp32 on the device against fp32 on the CPU (different kernels, same math): any micro-step's loss
LOSS_TOL = 1e-4
#: bf16/fp16 autocast against fp32 on the CPU: the mean absolute difference of the micro-steps' losses
LOSS_TOL_LOW = 0.05


def precisions(device: str) -> tuple[str, ...]:
    """fp32 and bf16 everywhere; fp16 (with the backend's gradient scaler) on CUDA."""
    return ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")


def train_digits(dist: Any, last: int = STEPS, restore: Callable[[Any, Any], int] | None = None,
                 stop: Callable[[int], bool] | None = None) -> tuple[Any, Any, list[float], list[float | None]]:
    """The loop itself, on a started `Distributed`: the set-up model and optimizer, every micro-step's loss
    (mean over the ranks) and each update's gradient norm before clipping (None where the backend clips inside
    its step). Also run by tests/multiproc/own_loop_worker.py, which stops it early (``last``: the update to
    stop before; ``stop(updates done)``: asked after each update, True ends the loop there) and resumes it
    (``restore(model, optimizer)`` loads a checkpoint and returns its step)."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    torch.manual_seed(0 if dist.is_main else 1)  # setup gives every rank rank 0's weights
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = dist.setup(model, optimizer)
    first = restore(model, optimizer) if restore is not None else 0
    losses, norms = [], []
    for step in range(first, last):
        size = GLOBAL_BATCH if step < STEPS - 1 else UNEVEN  # the last update's batches: fewer, unevenly shared
        for micro in range(ACCUM):
            start = (step * ACCUM + micro) * GLOBAL_BATCH % (len(x) - GLOBAL_BATCH)
            rows = slice(start + dist.rank, start + size, dist.world_size)
            xb, yb = x[rows].to(dist.device), y[rows].to(dist.device)
            with dist.accumulate(model):
                with dist.autocast():  # the global batch's mean: this rank's sum over all the step's samples, times
                    # the world size, as the ranks' gradients are averaged (a mean per rank would weigh a rank's
                    # samples more when it holds fewer)
                    loss = nn.functional.cross_entropy(model(xb), yb, reduction="sum") * dist.world_size / size
                dist.backward(loss)
            losses.append(float(dist.all_reduce(loss.detach().float(), "mean")))
        norm = dist.clip_grad_norm_(model, CLIP)
        norms.append(None if norm is None else float(norm))
        optimizer.step()
        optimizer.zero_grad()
        if stop is not None and stop(step + 1):
            break
    return model, optimizer, losses, norms


def loop_run(backend: str, precision: str, world: World, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the loop once on ``backend`` (``spec``: the case's other fields, e.g. the ZeRO stage); every
    micro-step's loss (mean over ranks) and where state lives."""
    import torch

    from polytrain.torch import Distributed

    spec = dict(spec or {})
    if backend == "deepspeed":  # the engine clips in its step, at the norm it was built with
        spec["loop"] = {"grad_clip_norm": CLIP}
    dist = Distributed(backend, precision=precision, grad_accum_steps=ACCUM, world=world, spec=spec)
    try:
        model, optimizer, losses, _ = train_digits(dist)
        params = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        inner = getattr(optimizer, "optimizer", optimizer)
        state = [v for slots in inner.state.values() for v in slots.values() if torch.is_tensor(v) and v.ndim]
        return {"losses": losses, "backend_label": dist.backend.label,
                "param_devices": sorted({p.device.type for p in params}),
                "state_devices": sorted({getattr(t, "_local_tensor", t).device.type for t in state})}
    finally:
        dist.end()


def loop_row(label: str, precision: str, record: Mapping[str, Any] | None, reference: Sequence[float] | None,
             device: str, missing: str = "no record", refusals: Sequence[str] = ()) -> Row:
    """One backend's loop against the CPU's: the losses, and where weights and momentum live."""
    case = f"own loop · {label} · {precision}"
    if record is None:
        return Row("own-loop", case, FAIL, "not run", "", missing)
    if "error" in record:
        everything = record["error"] + record.get("traceback", "")
        refused = any(marker in everything for marker in refusals)
        return Row("own-loop", case, INFO if refused else FAIL, "refused" if refused else "error", "",
                   record["error"])
    if not reference:
        return Row("own-loop", case, FAIL, "no CPU reference", "", "")
    losses = record.get("losses", [])
    if len(losses) != len(reference):
        return Row("own-loop", case, FAIL, f"{len(losses)} losses, the CPU run has {len(reference)}", "", "")
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    if precision == "fp32":
        worst, tol, what = max(diffs), LOSS_TOL, "max"
    else:
        worst, tol, what = sum(diffs) / len(diffs), LOSS_TOL_LOW, "mean"
    result = PASS if worst <= tol else FAIL
    notes = [record.get("backend_label", "")]
    placed = record.get("param_devices"), record.get("state_devices")
    if placed[0] != [device] or (placed[1] and placed[1] != [device]):
        result = FAIL
        notes.insert(0, f"weights on {placed[0]}, momentum on {placed[1]}, expected [{device!r}]")
    measured = (f"{what} |loss − CPU loss| {worst:.2e} over {len(losses)} micro-steps; "
                f"last loss {losses[-1]:.4f} (CPU {reference[-1]:.4f}); weights {','.join(placed[0] or [])}")
    return Row("own-loop", case, result, measured, f"{what} ≤ {tol:g}", "; ".join(n for n in notes if n))

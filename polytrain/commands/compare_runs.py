"""What `polytrain compare` reads of each run, how it sets runs side by side, and what a loop script writes for it.

A run is a directory holding ``metrics.jsonl`` (its ``step`` records: the step's loss and the time it was
logged) and the final ``model.safetensors`` with its ``model.json`` (`polytrain.checkpoint.store.write_model`). The
Trainer writes both (with ``loop.log_every_n_steps: 1`` every step has a record); a hand-written loop writes
them through `Record`.

Differences are taken against the reference run (the first backend): for the step losses and for every
weight tensor, the largest absolute difference, and the relative one, which is that largest absolute difference
divided by the largest absolute value of the same reference quantity (the whole loss series, the whole tensor).
Dividing by the largest value, not element by element, keeps a weight near zero from making a tiny difference
look large.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polytrain.observe import jsonfiles as jsonfiles

if TYPE_CHECKING:  # numpy only where used: every `polytrain` command imports this module
    import numpy as np

#: the variables `polytrain compare` gives a script's ranks (see `backend`, `steps`, `Record`)
ENV_BACKEND = "POLYTRAIN_COMPARE_BACKEND"
ENV_STEPS = "POLYTRAIN_COMPARE_STEPS"
ENV_OUT = "POLYTRAIN_COMPARE_OUT"


# ------------------------------------------------------------------------------ the script's side


def backend(default: str = "auto") -> str:
    """The backend `polytrain compare` runs this script on (``POLYTRAIN_COMPARE_BACKEND``), else ``default``."""
    return os.environ.get(ENV_BACKEND) or default


def steps(default: int) -> int:
    """The number of steps `polytrain compare` asks for (``POLYTRAIN_COMPARE_STEPS``), else ``default``."""
    raw = os.environ.get(ENV_STEPS)
    return int(raw) if raw else default


class Record:
    """A loop's record for `polytrain compare`: each step's loss and time, and the final weights.

    Inert (every call does nothing) unless `polytrain compare` started the script (``POLYTRAIN_COMPARE_OUT`` is
    set). ``dist``: the script's `polytrain.torch.Distributed`. Call `step` after every optimizer step on every
    rank (rank 0's value is recorded: pass the loss averaged over the ranks, e.g. ``dist.all_reduce(loss)``),
    then `save` on every rank with the set-up model (its full state is gathered on sharded backends).
    """

    def __init__(self, dist: Any) -> None:
        self.dist = dist
        out = os.environ.get(ENV_OUT)
        self.out = Path(out) if out else None
        self._log: Any = None
        self._count = 0

    def step(self, loss: Any) -> None:
        """Record one optimizer step's loss (a number or a one-element tensor) and the time now."""
        if self.out is None or not self.dist.is_main:
            return
        if self._log is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self._log = (self.out / "metrics.jsonl").open("a", buffering=1)
        self._count += 1
        value = float(loss.detach().float().item()) if hasattr(loss, "detach") else float(loss)
        self._log.write(jsonfiles.dumps({"event": "step", "time": time.time(), "step": self._count, "loss": value}) + "\n")

    def save(self, model: Any) -> None:
        """Write the final weights of ``model`` (every rank calls it; rank 0 writes) and close the record."""
        if self.out is None:
            return
        from polytrain.checkpoint.store import write_model

        state = self.dist.get_state_dict(model)
        if not self.dist.is_main:
            return
        arrays = {name: _to_numpy(tensor) for name, tensor in state.items()}
        self.out.mkdir(parents=True, exist_ok=True)
        write_model(self.out, arrays, {"backend": self.dist.backend_name, "world_size": self.dist.world_size,
                                       "global_step": self._count})
        if self._log is not None:
            self._log.close()
            self._log = None


def _to_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor as numpy; bf16 (which numpy lacks) as fp32, which holds every bf16 value exactly."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.float().numpy()


# ------------------------------------------------------------------------------ reading runs


@dataclass(frozen=True)
class Run:
    """What one run wrote: its step losses in order, its final weights, and its mean step time (seconds; None
    with fewer than two steps in one epoch)."""

    losses: np.ndarray
    weights: dict[str, np.ndarray]
    step_s: float | None


def read_run(path: Path) -> Run:
    """The step records of ``path/metrics.jsonl`` and the weights of ``path/model.safetensors``.

    The mean step time is the time between the first and the last step record of each epoch over the steps
    between them: the first step (start-up, warm-up) and the time between epochs (evaluation) are left out.
    """
    import numpy as np

    from polytrain.checkpoint.store import read_model

    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("event") == "step"]
    weights, _ = read_model(path)
    spans: dict[Any, list[dict[str, Any]]] = {}
    for record in records:
        spans.setdefault(record.get("epoch"), []).append(record)
    seconds = sum(span[-1]["time"] - span[0]["time"] for span in spans.values())
    intervals = sum(span[-1]["step"] - span[0]["step"] for span in spans.values())
    return Run(np.array([r["loss"] for r in records], dtype=np.float64),
               {name: np.asarray(value) for name, value in weights.items()},
               seconds / intervals if intervals > 0 else None)


# ------------------------------------------------------------------------------ differences and the table


@dataclass(frozen=True)
class Difference:
    """One run against the reference: the largest absolute and relative differences of the step losses and of
    the weights; ``problem`` says why they could not be taken (different step counts, names, shapes)."""

    loss_abs: float = 0.0
    loss_rel: float = 0.0
    weight_abs: float = 0.0
    weight_rel: float = 0.0
    problem: str | None = None

    def within(self, tolerance: float) -> bool:
        return self.problem is None and self.loss_rel <= tolerance and self.weight_rel <= tolerance


def _largest(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """The largest absolute difference and that divided by the reference's largest absolute value."""
    import numpy as np

    if reference.size == 0:
        return 0.0, 0.0
    ref, got = reference.astype(np.float64), other.astype(np.float64)
    worst = float(np.max(np.abs(got - ref)))
    if math.isnan(worst) or not np.all(np.isfinite(got) == np.isfinite(ref)):
        return math.inf, math.inf
    scale = float(np.max(np.abs(ref)))
    return worst, worst / scale if scale > 0 else (0.0 if worst == 0 else math.inf)


def difference(reference: Run, other: Run) -> Difference:
    """``other`` against ``reference`` (see the module's docstring for what relative means)."""
    if len(other.losses) != len(reference.losses):
        return Difference(problem=f"{len(other.losses)} step losses, the reference has {len(reference.losses)}")
    names, ref_names = sorted(other.weights), sorted(reference.weights)
    if names != ref_names:
        odd = sorted(set(names) ^ set(ref_names))
        return Difference(problem=f"other weight names than the reference: {', '.join(odd[:3])}"
                                  f"{' ...' if len(odd) > 3 else ''}")
    for name in names:
        if other.weights[name].shape != reference.weights[name].shape:
            return Difference(problem=f"weight {name} has shape {other.weights[name].shape}, the reference "
                                      f"{reference.weights[name].shape}")
    loss_abs, loss_rel = _largest(reference.losses, other.losses)
    pairs = [_largest(reference.weights[n], other.weights[n]) for n in names] or [(0.0, 0.0)]
    return Difference(loss_abs, loss_rel, max(p[0] for p in pairs), max(p[1] for p in pairs))


@dataclass(frozen=True)
class Row:
    """One backend's line of the table: ``run`` None when it failed (``failure`` says how), ``diff`` None for
    the reference or when there is no reference to compare with."""

    backend: str
    launcher: str
    run: Run | None
    diff: Difference | None = None
    failure: str | None = None


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def format_table(rows: Sequence[Row], tolerance: float) -> str:
    """The comparison as a fixed-width table, one line per backend, the reference first."""
    head = ("backend", "launcher", "steps", "loss abs", "loss rel", "weights abs", "weights rel", "step ms", "result")
    lines = [head]
    for i, row in enumerate(rows):
        step_ms = f"{row.run.step_s * 1e3:.2f}" if row.run and row.run.step_s is not None else "-"
        count = str(len(row.run.losses)) if row.run else "-"
        if row.failure is not None:
            cells = ("-",) * 4 + (step_ms, row.failure)
        elif i == 0:
            cells = ("",) * 4 + (step_ms, "reference")
        elif row.diff is None:
            cells = ("-",) * 4 + (step_ms, "no reference")
        elif row.diff.problem is not None:
            cells = ("-",) * 4 + (step_ms, f"DIFFERS: {row.diff.problem}")
        else:
            d = row.diff
            verdict = "ok" if d.within(tolerance) else "DIFFERS"
            cells = (_number(d.loss_abs), _number(d.loss_rel), _number(d.weight_abs), _number(d.weight_rel), step_ms,
                     verdict)
        lines.append((row.backend, row.launcher, count, *cells))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in lines)

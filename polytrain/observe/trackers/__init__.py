"""Experiment trackers (Weights & Biases, MLflow): sinks fed by rank 0's records, the same ones metrics.jsonl
holds, under the same names TensorBoard gets (``train/loss``, ``val/accuracy``).

A tracker is one module (a registry row, `polytrain.registry.TRACKERS`) with a class whose ``start`` opens (or,
given the id a checkpoint kept, reopens) its run and returns an object with ``run_id``, ``log(values, step)``,
``log_model(files)`` and ``finish(failed)``. `open_trackers` starts every tracker the spec names before
training: one that cannot start (a bad URI, an unwritable store) is a `UserError` naming its table. A tracker
that fails later (its store gone) is dropped with one warning, and training goes on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from polytrain import registry
from polytrain.errors import UserError
from polytrain.observe.redact import redact_text

# The same tags for every framework and backend, so runs overlay in one TensorBoard (and in one tracker).
SCALAR_TAGS = {
    "step": {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s",
             "loss_scale": "train/loss_scale", "skipped_steps": "train/skipped_steps"},
    "epoch": {"train_loss": "epoch/train_loss", "val_loss": "val/loss", "val_accuracy": "val/accuracy"},
}


def scalars(event: str, fields: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of one ``step``/``epoch`` record by tag (every ``val_<metric>`` as ``val/<metric>``);
    empty for other events."""
    if event not in SCALAR_TAGS:
        return {}
    tags = dict(SCALAR_TAGS[event])
    if event == "epoch":
        tags.update({k: f"val/{k.removeprefix('val_')}" for k in fields if k.startswith("val_")})
    out = {}
    for key, tag in tags.items():
        value = fields.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


class TrackerRun(Protocol):
    run_id: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def log_model(self, files: Sequence[Path]) -> None: ...

    def finish(self, failed: bool) -> None: ...


class Trackers:
    """Rank 0's open tracker runs, fed every record `polytrain.observe.metrics.MetricsLog` writes. A run whose call fails
    is dropped with one line on ``stream``; the others (and training) go on."""

    def __init__(self, runs: Mapping[str, TrackerRun] | None = None, stream: TextIO | None = None) -> None:
        self.runs = dict(runs or {})
        self.stream = stream

    def ids(self) -> dict[str, str]:
        """Each tracker's run id, kept in checkpoints so that a resumed run goes on in the same tracker run."""
        return {name: run.run_id for name, run in self.runs.items()}

    def record(self, event: str, fields: Mapping[str, Any]) -> None:
        values = scalars(event, fields)
        if values:
            self.log(values, int(fields.get("step", 0)))  # the step TensorBoard gets too

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._each(f"step {step}", lambda run: run.log(values, step))

    def log_model(self, files: Sequence[Path]) -> None:
        self._each("saving the final model", lambda run: run.log_model(files))

    def finish(self, failed: bool) -> None:
        self._each("its end", lambda run: run.finish(failed))
        self.runs.clear()

    def _each(self, when: str, call: Callable[[TrackerRun], None]) -> None:
        for name, run in list(self.runs.items()):
            try:
                call(run)
            except Exception as exc:  # noqa: BLE001 - a tracker must not end the training
                del self.runs[name]
                print(f"polytrain: warning: logging.{name} failed at {when} ({type(exc).__name__}: {one_line(exc)}); "
                      f"training goes on without it", file=self.stream or sys.stderr, flush=True)


def open_trackers(spec: Any, *, environment: Mapping[str, Any], resumed: Mapping[str, str] | None = None,
                  stream: TextIO | None = None) -> Trackers:
    """Start every tracker ``spec.logging`` names (rank 0 calls this); ``resumed``: the run ids a resumed
    checkpoint kept. Raises `UserError` (naming ``logging.<name>``) when one cannot start; those already started
    are finished first."""
    runs: dict[str, TrackerRun] = {}
    config = spec.to_dict()  # as written to files: every credential in a URI masked (polytrain.observe.redact)
    output = Path(spec.output)
    try:
        for name, options in spec.logging.trackers().items():
            entry = registry.tracker(name)
            reason = entry.unusable_reason()
            if reason:
                raise UserError(f"logging.{name}: {reason}")
            runs[name] = entry.load().start(options, output=output, run_id=(resumed or {}).get(name),
                                            config=config, environment=dict(environment))
    except BaseException:
        Trackers(runs, stream).finish(failed=True)
        raise
    return Trackers(runs, stream)


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``optimizer.lr``); lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters, every credential in a URI masked (a store's
    own error may quote its URI)."""
    text = redact_text(" ".join(str(exc).split()))
    return (text[:297] + "...") if len(text) > 300 else text or type(exc).__name__


def start_for_run(spec: Any, world: Any, backend: Any, resumed: Mapping[str, str]) -> Trackers:
    """Rank 0 starts the spec's trackers, in the runs a resumed checkpoint kept (``resumed``); every rank learns
    whether it could (one that cannot start ends every rank with rank 0's line). The other ranks, and a spec
    with none, get an empty `Trackers`."""
    if not spec.logging.trackers():
        return Trackers()
    from polytrain.comm.agree import library_versions
    from polytrain.comm.settle import settled

    environment = {"framework": spec.framework, "backend": backend.name, "launcher": world.launcher,
                   "world_size": world.size, **library_versions()}
    started = settled(backend, world.size, lambda: open_trackers(spec, environment=environment, resumed=resumed)
                      if world.rank == 0 else None)
    return started or Trackers()

"""What training minimises and what evaluation reports, by name: the loss and the metrics.

Framework-neutral: names, defaults per task and the exact reduction across ranks. Each framework
adapter computes the numbers (``adapters/<framework>/objectives.py``): a loss gives one value per
sample (the Trainer's exact-averaging rule sums them and scales the sum), a metric one value per
sample (per token for next-token data) that evaluation sums, with its count; the sums and counts
of every rank are added up before dividing, never averages of averages. ``perplexity`` is
``exp(validation loss)``, computed from the reduced loss.

A user's loss or metric gets the model's outputs shaped like the targets when the model has a single output
per target (`single_output`: a regression head's (batch, 1) against targets (batch,) comes as (batch,), as Keras
hands its losses), so ``abs(out - y)`` is per sample instead of broadcasting to (batch, batch); what it returns
is checked to be one value per sample (`per_sample_error` says what it got and what was expected).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from polytrain.errors import SpecError
from polytrain.spec.user_code import is_import_path, is_live, load_callable

F = TypeVar("F")

LOSSES = ("cross_entropy", "mse", "bce", "next_token")
METRICS = ("accuracy", "top5_accuracy", "mse", "mae", "perplexity")
#: computed from the reduced validation loss, not from per-sample values
DERIVED = ("perplexity",)

DEFAULT_LOSS = {"classification": "cross_entropy", "regression": "mse", "next_token": "next_token"}
DEFAULT_METRICS = {"classification": ("accuracy",), "regression": (), "next_token": ("accuracy",)}


def check_names(loss: str | None, metrics: Sequence[str] | None) -> None:
    """Every name is built in or an importable ``package.module:function`` (one-line errors)."""
    if loss is not None and not is_live(loss):
        if is_import_path(loss):
            load_callable(loss, "loss")
        elif loss not in LOSSES:
            raise SpecError(f"loss: {loss!r} is not a built-in loss (allowed: {', '.join(LOSSES)}, "
                            "or package.module:function returning one loss per sample)")
    for i, name in enumerate(metrics or ()):
        if is_live(name):
            continue
        if is_import_path(name):
            load_callable(name, f"metrics[{i}]")
        elif name not in METRICS:
            raise SpecError(f"metrics[{i}]: {name!r} is not a built-in metric (allowed: {', '.join(METRICS)}, "
                            "or package.module:function returning one value per sample)")
    if metrics is not None and len(set(metrics)) != len(metrics):
        raise SpecError(f"metrics: each metric may appear once, got {list(metrics)}")
    _check_keys(metrics or ())


def _check_keys(metrics: Sequence[str]) -> None:
    """Two metrics logged under one key (``accuracy`` and ``pkg.mod:accuracy``) would replace each other's
    values in every log, and a metric named ``loss`` the validation loss's."""
    seen: dict[str, int] = {}
    for i, name in enumerate(metrics):
        key = metric_key(name)
        if key == "loss":
            raise SpecError(f"metrics[{i}]: {name!r} would be logged as val_loss, the validation loss's key; "
                            "give the function another name")
        if key in seen:
            j = seen[key]
            raise SpecError(f"metrics[{i}]: {name!r} would be logged as val_{key}, like metrics[{j}] "
                            f"{metrics[j]!r}; give each metric function its own name")
        seen[key] = i


def resolve_loss(name: str, built_in: Mapping[str, F], checked: Callable[[Any, str, str], F], live: Any = None) -> F:
    """A framework's per-sample loss by name: ``live`` (a callable given to `polytrain.fit`), a user function
    by import path (both held to one value per sample by the framework's ``checked``), or a built-in."""
    if live is not None:
        return checked(live, "loss", name)
    return checked(load_callable(name, "loss"), "loss", name) if is_import_path(name) else built_in[name]


def resolve_metrics(names: Sequence[str], built_in: Mapping[str, F], checked: Callable[[Any, str, str], F],
                    live: Mapping[str, Any] | None = None) -> dict[str, F]:
    """The per-sample metric functions of ``names`` (the derived ones left out), resolved like the loss."""
    out = {}
    for i, name in enumerate(computed(names)):
        if live and name in live:
            out[name] = checked(live[name], f"metrics[{i}]", name)
        elif is_import_path(name):
            out[name] = checked(load_callable(name, f"metrics[{i}]"), f"metrics[{i}]", name)
        else:
            out[name] = built_in[name]
    return out


def loss_name(loss: str | None, task: str) -> str:
    return loss if loss is not None else DEFAULT_LOSS[task]


def metric_names(metrics: Sequence[str] | None, task: str) -> tuple[str, ...]:
    return tuple(metrics) if metrics is not None else DEFAULT_METRICS[task]


def computed(metrics: Sequence[str]) -> tuple[str, ...]:
    """The metrics a framework computes per sample (the derived ones come from the loss)."""
    return tuple(m for m in metrics if m not in DERIVED)


def metric_key(name: str) -> str:
    """How a metric is named in logs: a user function by its function name."""
    return name.rpartition(":")[2] if is_import_path(name) else name


def reduce(totals: Mapping[str, tuple[float, float]], metrics: Sequence[str]) -> tuple[float, dict[str, float]]:
    """(validation loss, {metric: value}) from summed (value, count) pairs; NaN where a count is 0."""
    def mean(pair: tuple[float, float]) -> float:
        return float(pair[0] / pair[1]) if pair[1] else math.nan

    loss = mean(totals["loss"])
    values = {}
    for name in metrics:
        if name == "perplexity":
            values[name] = math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf
        else:
            values[metric_key(name)] = mean(totals[name])
    return loss, values


Shape = tuple[Any, ...]  # a tensor's shape; None where TensorFlow does not know a size while tracing


class PerSampleError(SpecError):
    """A user's loss or metric did not return one value per sample (one line, exit code 2)."""

    #: raised while TensorFlow traces a step, AutoGraph passes it through as it is instead of folding the traced
    #: code's frames into its message: it stays one line
    ag_pass_through = True


def single_output(out_shape: Shape, y_shape: Shape) -> bool:
    """Whether outputs of ``out_shape`` hold one value per target of ``y_shape`` in a last axis of size 1 (a
    single-output head: (batch, 1) against (batch,)); a user's loss or metric then gets them shaped like the
    targets. Unknown sizes (None) match any."""
    if len(out_shape) != len(y_shape) + 1 or out_shape[-1] != 1:
        return False
    return all(a is None or b is None or a == b for a, b in zip(out_shape, y_shape))


def per_sample_error(field_name: str, name: str, returned: Any, out_shape: Shape, y_shape: Shape) -> PerSampleError:
    """The one line for a user loss or metric that did not return one value per sample: what it was given and
    what it returned (``returned``: a shape, or a type's name)."""
    def shown(shape: Shape) -> str:
        return "(" + ", ".join("batch" if n is None else str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"

    got = shown(returned) if isinstance(returned, tuple) else returned
    batch = "batch" if not y_shape or y_shape[0] is None else str(y_shape[0])
    return PerSampleError(f"{field_name}: {name} returned {got} for outputs of shape {shown(out_shape)} and targets of "
                     f"shape {shown(y_shape)}; it must return one value per sample, shape ({batch},) (not reduced "
                     f"to a mean or a sum, nor broadcast across samples)")

"""The loss and the metrics on PyTorch tensors (names and reduction rules: `polytrain.spec.objectives`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from polytrain.spec import objectives as objectives
from polytrain.spec.user_code import call_user

PerSample = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _flat(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and targets as (batch, values) of the output's dtype (a regression head's (batch, 1) included)."""
    return out.reshape(len(y), -1), y.reshape(len(y), -1).to(out.dtype)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = _flat(out, y)
    return (a - b).square().mean(dim=1)


def _mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = _flat(out, y)
    return (a - b).abs().mean(dim=1)


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a, b = _flat(out, y)
    return F.binary_cross_entropy_with_logits(a, b, reduction="none").mean(dim=1)


def _next_token(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(batch, length, vocab) logits: each sample's mean loss over its tokens."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(dim=1)


LOSSES: dict[str, PerSample] = {
    "cross_entropy": lambda out, y: F.cross_entropy(out, y, reduction="none"),
    "mse": _mse,
    "bce": _bce,
    "next_token": _next_token,
}


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(dim=-1) == y).to(torch.float32).flatten()


def _top5(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    top = out.topk(min(5, out.shape[-1]), dim=-1).indices
    return (top == y.unsqueeze(-1)).any(dim=-1).to(torch.float32).flatten()


METRICS: dict[str, PerSample] = {"accuracy": _correct, "top5_accuracy": _top5, "mse": _mse, "mae": _mae}


def _checked(fn: Any, field_name: str, name: str) -> PerSample:
    """The user's function, given a single-output head's outputs shaped like the targets
    (`polytrain.spec.objectives.single_output`) and held to one value per sample (a one-line error otherwise)."""
    def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        given = out.squeeze(-1) if objectives.single_output(tuple(out.shape), tuple(y.shape)) else out
        value = call_user(field_name, name, fn, given, y)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (len(y),):
            returned = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise objectives.per_sample_error(field_name, name, returned, tuple(given.shape), tuple(y.shape))
        return value
    return per_sample


def loss_fn(name: str, live: Any = None) -> PerSample:
    """The loss by name; ``live``: a callable given to `polytrain.fit` (the spec names it ``fit:<name>``)."""
    return objectives.resolve_loss(name, LOSSES, _checked, live)


def metric_fns(names: tuple[str, ...], live: Mapping[str, Any] | None = None) -> dict[str, PerSample]:
    return objectives.resolve_metrics(names, METRICS, _checked, live)


def evaluation(loss_name: str, loss: PerSample, metrics: dict[str, PerSample], out: torch.Tensor,
               y: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(sum, count) of the loss and of every metric over one batch. The built-in next-token loss is
    summed per token (the validation loss is per next token), every other loss per sample."""
    out = out.float()
    if loss_name == "next_token":
        per = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
    else:
        per = loss(out, y)
    totals = {"loss": (float(per.sum()), float(per.numel()))}
    for name, fn in metrics.items():
        values = fn(out, y)
        totals[name] = (float(values.sum()), float(values.numel()))
    return totals

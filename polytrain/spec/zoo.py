"""The model zoo, framework-neutral: names, their parameters and validation.

Each framework adapter builds the same architecture from these parameters, with the
same parameter names and shapes (see ``docs/portable-state.md``), so a state exported
by one framework loads into the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polytrain.errors import SpecError
from polytrain.spec.schema import build, rule
from polytrain.spec.user_code import is_import_path, is_live, load_callable


@dataclass(frozen=True)
class MLPParams:
    hidden_sizes: tuple[int, ...] = (128, 64)
    activation: str = rule("relu", choices=("relu", "gelu", "tanh"))


@dataclass(frozen=True)
class ConvNetParams:
    channels: tuple[int, ...] = (16, 32)
    kernel_size: int = rule(3, choices=(3, 5))
    activation: str = rule("relu", choices=("relu", "gelu", "tanh"))


@dataclass(frozen=True)
class TransformerParams:
    """A decoder-only LM; vocabulary and sequence length come from the token data (data.tokens)."""

    d_model: int = rule(64, min=1)
    n_heads: int = rule(4, min=1)
    n_layers: int = rule(2, min=1)
    d_ff: int | None = rule(None, min=1)  # MLP width; null: 4 × d_model
    tie_weights: bool = True  # the output head shares the token embedding matrix
    dropout: float = rule(0.0, min=0.0, max=0.9)


ZOO: dict[str, type] = {"mlp": MLPParams, "convnet": ConvNetParams, "transformer": TransformerParams}


def model_params(name: str, params: Mapping[str, Any]) -> Any:
    """Validated parameters of a zoo model (a dataclass), or the raw mapping for a user factory."""
    if is_live(name):  # a model object given to polytrain.fit
        return dict(params)
    if is_import_path(name):
        load_factory(name)
        return dict(params)
    if name not in ZOO:
        raise SpecError(f"model.name: unknown model {name!r} (allowed: {', '.join(ZOO)}, or package.module:factory)")
    params_obj = build(ZOO[name], params, "model.params")
    for i, size in enumerate(getattr(params_obj, "hidden_sizes", ()) + getattr(params_obj, "channels", ())):
        if size < 1:
            raise SpecError(f"model.params: sizes must be >= 1, got {size} at position {i}")
    if isinstance(params_obj, TransformerParams) and params_obj.d_model % params_obj.n_heads:
        raise SpecError(f"model.params.n_heads: {params_obj.n_heads} does not divide d_model {params_obj.d_model}")
    return params_obj


def load_factory(path: str) -> Any:
    """Import ``package.module:factory``; one-line errors when it is not there."""
    return load_callable(path, "model.name")

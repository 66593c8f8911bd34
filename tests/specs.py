"""Specs several tests share, as spec dicts: the tiny transformer LM, and the parity job on it.

``from specs import lm, merged, as_sets, PARITY_TRAINING`` (tests/ is on pytest's pythonpath). `lm` is the zoo
transformer on the built-in token corpus, small enough for a CPU test; `merged` lays changes over a spec
(a None value removes a field, leaving the default); `as_sets` turns a spec into the ``--set`` values a
process test passes to ``procs.train``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the tiny LM: 4 heads of 8 dimensions, 2 blocks (tied head, no dropout: the zoo's defaults)
SIZE = {"d_model": 32, "n_heads": 4, "n_layers": 2}
#: the token corpus the process tests train it on: 512 sequences of 16 tokens over a vocabulary of 32
TOKENS = {"samples": 512, "seq_len": 16, "vocab": 32}

#: the job the parity tests run on it (2 ranks against one process): fp32 SGD with momentum (Adam would turn the
#: rounding noise of gradients that are truly zero, an attention key bias's, into full-size steps), a cosine
#: decay set every step, 2 micro-steps of accumulation, clipping that bites, 22 steps, every step logged
PARITY_TRAINING: dict[str, Any] = {
    "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.9},
    "schedule": {"decay": "cosine"},
    "loop": {"epochs": 2, "max_steps": 22, "grad_accum_steps": 2, "grad_clip_norm": 0.5, "log_every_n_steps": 1},
}


def lm(*, tokens: Mapping[str, Any] | None = TOKENS, data: Mapping[str, Any] | None = None,
       **params: Any) -> dict[str, Any]:
    """The tiny LM (`SIZE`, with ``params`` changed or added) on the built-in token corpus: ``tokens`` its size
    (None: the spec's defaults, for a test that never loads it), ``data`` further data fields."""
    data_fields = {"name": "tokens", **(data or {}), **({"tokens": dict(tokens)} if tokens is not None else {})}
    return {"model": {"name": "transformer", "params": {**SIZE, **params}}, "data": data_fields}


def merged(spec: Mapping[str, Any], *changes: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with each of ``changes`` laid over it, table by table; a None value removes the field."""
    out = {key: dict(value) if isinstance(value, Mapping) else value for key, value in spec.items()}
    for change in changes:
        for key, value in change.items():
            if value is None:
                out.pop(key, None)
            elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = merged(out[key], value)
            else:
                out[key] = value
    return out


def _text(value: Any) -> str:
    """A value as ``--set`` reads it back (YAML): text as it is, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def as_sets(spec: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``spec`` as ``KEY=VALUE`` overrides, one per field (``model.params.d_model=32``)."""
    out = []
    for key, value in spec.items():
        if isinstance(value, Mapping) and value:
            out += as_sets(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={_text(value)}")
    return out


def data_spec(source: str, path: Path | str | None = None, /, **fields: Any) -> Any:
    """A ``data`` table (`polytrain.spec.tables.DataSpec`) of ``source`` reading ``path``, with ``fields``: what the
    data-source tests hand a source's ``open_*`` directly."""
    from polytrain.spec.tables import DataSpec

    return DataSpec(**{"name": source, **({"path": str(path)} if path is not None else {}), **fields})

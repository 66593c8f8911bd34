"""The own-loop API's precision: the set-up model's forward under autocast, its outputs back in fp32."""

from __future__ import annotations

import functools
from typing import Any

import torch


def autocast_forward(forward: Any, device_type: str, dtype: torch.dtype, cast_inputs: bool = False) -> Any:
    """``forward`` run under autocast, its floating-point outputs returned as fp32 (so a loss outside it is
    computed at full precision); with ``cast_inputs``, floating-point tensor arguments are cast to ``dtype``."""

    def cast(value: Any) -> Any:
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs:
            args, kwargs = tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return to_fp32(out)

    return run


def to_fp32(out: Any) -> Any:
    if torch.is_tensor(out):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if type(out) is dict:
        return {k: to_fp32(v) for k, v in out.items()}
    if type(out) in (list, tuple):
        return type(out)(to_fp32(v) for v in out)
    return out  # other containers as they are

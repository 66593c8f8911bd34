"""Strict JSON for every file polytrain writes: ``metrics.jsonl``, ``model.json``, checkpoint manifests,
``best/index.json``, timelines.

Python's ``json`` writes a non-finite float as a bare ``NaN``/``Infinity``, which is not JSON: strict parsers
(``jq``, JavaScript, most JSON tools) reject the whole line. Here a non-finite number is written as ``null`` (a
diverged loss reads back as None), numpy scalars are written as the plain numbers they hold, and anything
still non-finite is an error rather than invalid output (``allow_nan=False``).
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf; numpy's too) replaced by None and numpy scalars made
    Python numbers, through dicts, lists and tuples (tuples become lists, as JSON has no tuples). Other objects
    are returned as they are (for ``json.dumps``' ``default``)."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # a numpy scalar (or 0-d array) as the Python number it holds; numpy not imported here
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of `finite` (``value``): strict JSON, non-finite numbers as ``null``. ``kwargs`` are
    ``json.dumps``' (``indent``, ``sort_keys``, ``default``, ...)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)

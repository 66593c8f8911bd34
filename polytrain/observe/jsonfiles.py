"""Strict JSON for every file polytrain writes: ``metrics.jsonl``, ``model.json``, checkpoint manifests,
``best/index.json``, timelines.

Python's ``json`` writes a non-finite float as a bare ``NaN``/``Infinity``, which is not JSON: strict parsers
(``jq``, JavaScript, most JSON tools) reject the whole line. Here a non-finite number is written as ``null`` (a
diverged loss reads back as None), numpy scalars are written as the plain numbers they hold, and anything
still non-finite is an error rather than invalid output (``allow_nan=False``). Where a value must come back as it
was (a hand-written loop's state in a checkpoint), `exact` and `unexact` keep non-finite floats, tuples and
non-string dict keys in strict JSON.
"""

from __future__ import annotations

import json
import math
from collections import Counter
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


# ---------------------------------------------------------------- exact values
# What a hand-written loop keeps in a checkpoint's manifest (its plain values, an LR scheduler's state_dict()) must
# come back as it was, also where plain JSON has no form for it: ReduceLROnPlateau holds ``inf``, MultiStepLR a
# Counter keyed by ints, an optimizer group a tuple. `exact` writes those as one-key objects tagged with a key that
# starts with "$", and escapes the user's own "$" keys (one "$" more), so `unexact` tells them apart; the file stays
# strict JSON.
FLOAT, TUPLE, ITEMS, COUNTER = "$float", "$tuple", "$items", "$counter"
_TAGS = (FLOAT, TUPLE, ITEMS, COUNTER)
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-nan": -math.nan}


class NotPlain(TypeError):
    """A value `exact` cannot keep: ``where`` (``'key'[0]['x']``) is an object of kind ``kind``."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where} is a {kind}")
        self.where, self.kind = where, kind


def exact(value: Any, where: str = "value") -> Any:
    """``value`` (None, bools, ints, floats, strings, and lists, tuples and dicts of them; dict keys of those kinds;
    numpy scalars as the numbers they hold) as strict JSON that `unexact` turns back into an equal value of the same
    types: a non-finite float ``{"$float": "inf"}`` (``-inf``, ``nan``, ``-nan``), a tuple ``{"$tuple": [...]}``, a
    dict with a key that is not a string ``{"$items": [[key, value], ...]}`` (a ``collections.Counter``:
    ``"$counter"``; other dict classes become dicts), a string key that starts with "$" one "$" longer. Anything
    else raises `NotPlain`, naming where in ``value`` it is (``where``: the name of the whole)."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {FLOAT: ("-" if math.copysign(1.0, value) < 0 else "") + ("nan" if math.isnan(value) else "inf")}
    if isinstance(value, list):
        return [exact(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {TUPLE: [exact(item, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {("$" + key if key.startswith("$") else key): exact(item, f"{where}[{key!r}]")
                    for key, item in value.items()}
        items = [[exact(key, f"{where} (a key)"), exact(item, f"{where}[{key!r}]")] for key, item in value.items()]
        return {COUNTER if isinstance(value, Counter) else ITEMS: items}
    raise NotPlain(where, type(value).__name__)


def unexact(value: Any) -> Any:
    """The value `exact` wrote (``ValueError`` for a tagged object it cannot have written)."""
    if isinstance(value, list):
        return [unexact(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and (tag := next(iter(value))) in _TAGS:
        content = value[tag]
        if tag == FLOAT:
            if content not in _NON_FINITE:
                raise ValueError(f"{{{tag!r}: {content!r}}}: expected one of {', '.join(_NON_FINITE)}")
            return _NON_FINITE[content]
        if not isinstance(content, list):
            raise ValueError(f"{{{tag!r}: ...}} holds a {type(content).__name__}, not a list")
        if tag == TUPLE:
            return tuple(unexact(item) for item in content)
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in content):
            raise ValueError(f"{{{tag!r}: ...}} holds something other than [key, value] pairs")
        pairs = [(_key(unexact(key)), unexact(item)) for key, item in content]
        return Counter(dict(pairs)) if tag == COUNTER else dict(pairs)
    return {(key[1:] if key.startswith("$") else key): unexact(item) for key, item in value.items()}


def _key(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise ValueError(f"a dict key cannot be a {type(key).__name__}")
    return key

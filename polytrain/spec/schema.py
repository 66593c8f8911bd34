"""Validated frozen dataclasses from plain data: the machinery behind `polytrain.spec.tables`, the zoo's
model parameters and the backends' option tables.

A dataclass declares its fields with type hints and, where a value is constrained, ``rule(default,
choices=..., min=..., max=...)``. `build(cls, raw, prefix)` turns a mapping into an instance or raises
a `SpecError` whose one-line message names the field by its dotted path and says what is allowed.
Choices that a dataclass cannot hold (names kept in a registry the dataclass's module must not import) are
given to `build` by dotted path.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from polytrain.errors import SpecError


def rule(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field with a default and its validation ``metadata``: ``choices``, ``min``, ``max``,
    ``min_exclusive``."""
    if isinstance(default, (list, dict)):
        raise TypeError("use a tuple or a Mapping default")
    return field(default=default, metadata=meta)


def digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shown(text: Any) -> str:
    """``text`` as it goes into a one-line message: itself, or quoted with escapes when it holds a line
    break or another character that does not print."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list"
        return f"a list of {len(args)} numbers"
    if dataclasses.is_dataclass(tp):
        return "a table"
    if origin is not None and issubclass(origin, Mapping):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str, choices: Mapping[str, Sequence[Any]] | None = None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tables = [arg for arg in args if dataclasses.is_dataclass(arg)]
        if len(tables) == 1 and isinstance(value, Mapping):  # a table: its own field's error, not "expected ..."
            return coerce(value, tables[0], where, choices)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where, choices)
            except SpecError:
                continue
        hint = number_hint(value) if float in args else ""
        raise SpecError(f"{where}: expected {type_name(tp)}, got {value!r}{hint}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise SpecError(f"{where}: expected a table of {field_list(tp)}, got {value!r}")
        return build(tp, value, where, choices)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            if isinstance(value, str) or not isinstance(value, Sequence) or not value:
                raise SpecError(f"{where}: expected a non-empty list of {type_name(args[0])}, got {value!r}")
            return tuple(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != len(args):
            raise SpecError(f"{where}: expected a list of {len(args)} numbers, got {value!r}")
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is not None and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise SpecError(f"{where}: expected a table, got {value!r}")
        return types.MappingProxyType(dict(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2**1023 else math.inf
            if not math.isfinite(number):  # NaN passes every range check; inf overflows the timeouts
                raise SpecError(f"{where}: expected a finite number, got {value!r}")
            return number
        raise SpecError(f"{where}: expected a number, got {value!r}{number_hint(value)}")
    if tp is str:
        if isinstance(value, str) and value:
            return value
        raise SpecError(f"{where}: expected a non-empty string, got {value!r}")
    raise TypeError(f"unsupported spec type {tp!r} at {where}")  # a bug in this module


def number_hint(value: Any) -> str:
    """Why a number-looking string is text, and what to write: PyYAML (YAML 1.1, spec files and ``--set``) reads a
    number with an exponent only with a dot in the mantissa and a sign in the exponent (``1.0e+8``; ``1e8`` and
    ``1.0e8`` are text), and ``-.5`` only with a digit before the dot; a number YAML does read was quoted."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    if _yaml_reads_a_number(value):
        return " (a quoted number is text; write it without quotes)"
    written = yaml_number(value.strip())
    why = "it needs a dot and a signed exponent" if "e" in value.lower() else "it needs a digit before the dot"
    return f" (YAML reads {value} as text: {why}; write {written})"


def yaml_number(text: str) -> str:
    """``text`` (a number Python's ``float`` reads) in the form PyYAML reads as a number: ``1e8`` -> ``1.0e+8``,
    ``1.0e8`` -> ``1.0e+8``, ``-.5`` -> ``-0.5``."""
    sign = text[:1] if text[:1] in "+-" else ""
    mantissa, e, exponent = text[len(sign):].lower().partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    if mantissa.startswith("."):
        mantissa = "0" + mantissa
    if e and exponent[:1] not in ("+", "-"):
        exponent = "+" + exponent
    return f"{sign}{mantissa}{e}{exponent}"


def _yaml_reads_a_number(text: str) -> bool:
    import yaml

    try:
        return isinstance(yaml.safe_load(text), (int, float))
    except Exception:  # noqa: BLE001 - not YAML at all: not a number YAML reads
        return False


def check_rule(value: Any, meta: Mapping[str, Any], where: str) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise SpecError(f"{where}: {value!r} is not allowed (allowed: {', '.join(map(str, choices))})")
    low, high = meta.get("min"), meta.get("max")
    if low is not None and (value < low or (meta.get("min_exclusive") and value == low)):
        bound = f"> {low}" if meta.get("min_exclusive") else f">= {low}"
        raise SpecError(f"{where}: {value!r} is out of range (must be {bound})")
    if high is not None and value > high:
        raise SpecError(f"{where}: {value!r} is out of range (must be <= {high})")


def field_list(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def build(cls: type, raw: Mapping[str, Any], prefix: str,
          choices: Mapping[str, Sequence[Any]] | None = None) -> Any:
    """An instance of ``cls`` from ``raw``; ``choices``: allowed values by dotted path (``data.name``), checked
    as a field's own ``choices`` are, in the same order."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            where = f"{prefix}.{shown(key)}" if prefix else shown(key)
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(f"{where}: unknown field{hint}; allowed: {', '.join(fields)}")
    kwargs = {}
    for name, value in raw.items():
        where = f"{prefix}.{name}" if prefix else name
        coerced = coerce(value, hints[name], where, choices)
        meta = fields[name].metadata
        if choices is not None and where in choices:
            meta = {**meta, "choices": choices[where]}
        check_rule(coerced, meta, where)
        kwargs[name] = coerced
    return cls(**kwargs)


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every field of a dataclass as a dotted path (``loop.epochs``), tables included, for suggestions."""
    hints = typing.get_type_hints(cls)
    paths = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        paths.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            paths += field_paths(hints[f.name], f"{path}.")
    return paths

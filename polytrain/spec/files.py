"""Reading a spec file (YAML, TOML, JSON) into plain data, and ``--set KEY=VALUE`` overrides, with
one-line errors that say where the text is wrong."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import SpecError
from polytrain.spec.schema import shown


class _DuplicateKey(ValueError):
    """A key given twice in one table (YAML and JSON parsers keep the last one silently)."""

    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


_YAML_LOADER: Any = None


def _yaml_loader() -> Any:
    """yaml.SafeLoader, except that a key given twice in one table is an error (YAML requires unique keys)."""
    global _YAML_LOADER
    if _YAML_LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
                return super().construct_mapping(node, deep)

        _YAML_LOADER = UniqueKeyLoader
    return _YAML_LOADER


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's multi-line error as one line: where, what, and in which construct."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return ": " + " ".join(str(exc).split())
    text = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} started at line {context_mark.line + 1}, column {context_mark.column + 1})"
    if "'\\t'" in problem:
        text += "; indent with spaces, not tabs"
    return text


def _check_numbers(data: Any, source: str) -> None:
    """An integer too long to print (YAML and TOML read ``0x`` followed by thousands of digits) cannot be
    named in any message, nor written to a manifest: refuse it here, in one line."""
    stack, seen = [data], set()
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            try:
                str(item)
            except ValueError:
                raise SpecError(f"{source}: an integer of {item.bit_length()} bits is too large to be a spec "
                                f"value") from None
        elif isinstance(item, (Mapping, list, tuple, set)) and id(item) not in seen:  # aliases may form loops
            seen.add(id(item))
            stack.extend([*item.keys(), *item.values()] if isinstance(item, Mapping) else item)


def parse_text(text: str, suffix: str, source: str = "spec") -> dict[str, Any]:
    """Parse YAML/TOML/JSON text into plain data, with a one-line error on bad syntax."""
    data = _parse(text, suffix, source)
    _check_numbers(data, source)
    return data


def _parse(text: str, suffix: str, source: str) -> Any:
    kind = suffix.lstrip(".").upper() or "YAML"
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_json_pairs)
        import yaml

        try:
            data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass: plain data only
        except yaml.YAMLError as exc:
            raise SpecError(f"{source}: cannot parse YAML{_yaml_problem(exc)}") from exc
        return {} if data is None else data
    except _DuplicateKey as exc:
        where = f" at line {exc.line}" if exc.line else ""
        raise SpecError(f"{source}: duplicate key {exc.key!r}{where} (each key may appear once in a table)") from exc
    except SpecError:
        raise
    except Exception as exc:  # each parser has its own error class; all mean "bad syntax"
        detail = " ".join(str(exc).split())
        raise SpecError(f"{source}: cannot parse {kind}: {detail}") from exc


def load_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    name = shown(path)
    if path.suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise SpecError(f"spec: {name}: unknown file type (allowed: .yaml, .yml, .toml, .json)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"spec: cannot read {name}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"spec: {name} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                        f"{exc.start}); save it as UTF-8") from exc
    data = parse_text(text, path.suffix, name)
    if not isinstance(data, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(data).__name__} ({name} must hold "
                        f"fields such as 'framework: torch')")
    return data


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars/lists)."""
    import copy

    import yaml

    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(raw).__name__}")
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optimizer.lr=0.1")
        flag = f"--set {shown(key)}"
        try:
            value = yaml.safe_load(text)
        except Exception as exc:  # YAMLError; ValueError for an integer of thousands of digits; RecursionError
            raise SpecError(f"{flag}: cannot parse value {text!r} as YAML (e.g. 3, 0.1, true, text, "
                            f"[64, 32] or {{name: adam}}; quote text that has brackets or colons)") from exc
        _check_numbers(value, flag)
        node = out
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                table = ".".join(parts[: i + 1])
                raise SpecError(f"{flag}: {table!r} is {child!r}, not a table, so it has no {parts[i + 1]!r}")
            node = child
        node[parts[-1]] = value
    return out


def readable_with_overrides(path: str | Path, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The spec file's tables with ``overrides`` applied, or None where that cannot be read here (a launcher
    building a command for another machine looks at the spec only to add what it lacks)."""
    from polytrain.errors import UserError

    try:
        return apply_overrides(load_raw(path), overrides)
    except (UserError, OSError):
        return None


def set_values(program_args: Sequence[str]) -> list[str]:
    """The ``--set KEY=VALUE`` overrides among the arguments for ``polytrain train``."""
    values = []
    for i, arg in enumerate(program_args):
        if arg == "--set":
            values.append(program_args[i + 1] if i + 1 < len(program_args) else "")
        elif arg.startswith("--set="):
            values.append(arg.removeprefix("--set="))
    return values

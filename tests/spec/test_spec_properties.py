"""Property-based: whatever a spec file or a ``--set`` holds, it loads or ends in one line, never a traceback.

Generated inputs (hypothesis): arbitrary text put together from YAML/TOML/JSON syntax and spec field
names, raw bytes, structured specs (real and made-up field paths holding values of any type: nested
tables, lists, huge and non-finite numbers, unicode, empty strings) written as YAML, JSON and TOML,
and arbitrary ``--set`` strings. Each goes through the function ``polytrain train`` loads a spec with
(`polytrain.validation.load`) and must give a spec or a `UserError` whose message is one line; the CLI
(``polytrain.cli.main`` in-process, training replaced by a recorder) must return 0, or 2 with exactly
one ``polytrain...: error:`` line on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import tempfile
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from polytrain import cli, validation
from polytrain.errors import UserError
from polytrain.spec import tables as spec_mod
from polytrain.spec.tables import TrainSpec
from polytrain.train import trainer as trainer_mod

FIELD_PATHS = spec_mod.field_paths()
NAMES = sorted({part for path in FIELD_PATHS for part in path.split(".")})
SUFFIXES = (".yaml", ".yml", ".json", ".toml")
HUGE_HEX = "0x" + "f" * 4000  # an integer YAML and TOML read whole: more decimal digits than str() converts
PROPERTY = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: Pieces of spec syntax (all three formats), interesting scalars and names, to build text from.
FRAGMENTS = st.sampled_from([
    "\n", "  ", "\t", ": ", ":", "- ", "-", "[", "]", "{", "}", ",", "=", "\"", "'", "#", ".", "---\n", "...\n",
    "&a ", "*a", "<<: *a", "? ", "!!binary ", "!!python/object:os.system ", "!!set ", "!!str ", "%YAML 1.1\n",
    "[table]\n", "[[arr]]\n", "a.b = 1\n", "\"\"\"", "'''", "0x", "0o17", "0b101", "1e999", "1.0e400", "-1", "0",
    "2001-01-01", "1979-05-27T07:32:00Z", ".nan", ".inf", "NaN", "Infinity", "nan", "inf", "true", "null", "~",
    "\\u0000", "\\ud800", "\\x00", "\u00e9", "\u2028", "\U0001f600", "\ufeff", HUGE_HEX, "9" * 5000, "1:x",
    "os:system", "...:x", "nosuchmod_q:f",
    *NAMES, *FIELD_PATHS,
])
TEXT = st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=40).map("".join)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", " ", "\n", "a\nb", "\x00", "x:y", "nosuchmod_q:f", "fit:model", "*", "/", "[0-9]",
                     "torch", "tensorflow", "mlp", "transformer", "npz", "csv", "images", "tokens", "deepspeed",
                     "fsdp", "horovod", "ddp", "mpi", "sgd", "adam", "fp16", "bf16", "accuracy", "mse", "x" * 5000]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=6)), inner,
                                                 max_size=4)), max_leaves=12)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``; a path under a value that is not a table is left out."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node, parts = out, path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return out


def field_values(tp: Any, meta: Any) -> st.SearchStrategy[Any]:
    """Values of a spec field's own type, mostly in range (its ``rule``), sometimes just outside it."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return st.one_of(*[field_values(a, meta) for a in typing.get_args(tp)])
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if "choices" in meta:
        return st.one_of(st.sampled_from(meta["choices"]), st.text(max_size=4))
    low, high = meta.get("min", -2), meta.get("max", 2 * (meta.get("min") or 0) + 64)
    if tp is int:
        return st.integers(int(low) - 1, int(high) + 1)
    if tp is float:
        return st.one_of(st.floats(low - 0.5, high + 0.5), st.sampled_from([math.nan, math.inf]))
    if typing.get_origin(tp) is tuple:
        return st.lists(st.one_of(st.integers(-1, 64), st.floats(0.0, 1.0), st.sampled_from(["accuracy", "mse", ""])),
                        max_size=3)
    return st.one_of(st.text(max_size=6), st.dictionaries(st.sampled_from(NAMES), st.integers(0, 8), max_size=2))


def typed_fields(cls: type, prefix: str = "") -> dict[str, st.SearchStrategy[Any]]:
    """Each leaf field of a spec (``loop.epochs``) with a strategy for values of its type."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(typed_fields(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = field_values(hints[f.name], f.metadata)
    return out


TYPED = typed_fields(TrainSpec)
#: Structured specs: a few fields with values of their own type (so that many specs load and the rules
#: between fields run), or real and made-up field paths holding anything at all.
SPECS = st.one_of(
    st.lists(st.sampled_from(sorted(TYPED)), max_size=4, unique=True).flatmap(
        lambda paths: st.fixed_dictionaries({p: TYPED[p] for p in paths})).map(nest),
    st.dictionaries(st.one_of(st.sampled_from(FIELD_PATHS), st.sampled_from(NAMES), st.text(max_size=10)),
                    VALUES, max_size=6).map(nest))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}"
                               for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def dump(data: dict[str, Any], suffix: str) -> str:
    """``data`` in the file format of ``suffix`` (TOML has no null: those keys are left out)."""
    if suffix == ".json":
        return json.dumps(data, ensure_ascii=False, allow_nan=True, default=str)
    if suffix == ".toml":
        return "".join(f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}\n"
                       for k, v in data.items() if v is not None)
    return yaml.safe_dump(data, allow_unicode=True)


SET_KEYS = st.one_of(st.sampled_from(FIELD_PATHS), st.lists(st.sampled_from([*NAMES, "", "x", "0", " "]),
                                                            min_size=1, max_size=4).map(".".join), TEXT)
SET_VALUES = st.one_of(TEXT, VALUES.map(lambda v: json.dumps(v, ensure_ascii=False, default=str)))
def flow(value: Any) -> str:
    """``value`` as YAML on one line, the way a ``--set`` value is written."""
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("\n...\n").strip()


TYPED_SETS = st.sampled_from(sorted(TYPED)).flatmap(lambda path: TYPED[path].map(lambda v: f"{path}={flow(v)}"))
SETS = st.lists(st.one_of(TYPED_SETS, st.tuples(SET_KEYS, st.sampled_from(["=", "=", ":", ""]), SET_VALUES).map("".join), TEXT),
                max_size=4)


def count(outcome: str) -> None:
    """Tally outcomes in hypothesis's statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(outcome)


def load_outcome(path: Path | None, sets: list[str]) -> TrainSpec | str:
    """The loaded spec, or the UserError's message, which must be one line; anything else is raised."""
    try:
        spec = validation.load(path, sets)
    except UserError as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message and "\r" not in message, repr(message)
        count("error")
        return message
    count("loaded")
    assert all(math.isfinite(v) for v in numbers(spec)), spec  # NaN would pass every range check
    return spec


def numbers(value: Any) -> Iterator[float]:
    """The floats of a spec's own fields (not the free-form tables handed to user code)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from numbers(getattr(value, f.name))
    elif isinstance(value, tuple):
        for item in value:
            yield from numbers(item)
    elif isinstance(value, float):
        yield value


class Recorder:
    """Stands in for the Trainer: a spec that loaded is all the CLI's part of the work."""

    specs: list[TrainSpec] = []

    def __init__(self, spec: TrainSpec, **_: Any) -> None:
        Recorder.specs.append(spec)

    def fit(self) -> None:
        pass


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """One directory for the module (hypothesis calls a test many times; function fixtures are not reset)."""
    with tempfile.TemporaryDirectory(prefix="polytrain-props-") as name, \
            mock.patch.object(trainer_mod, "Trainer", Recorder), mock.patch.object(cli, "_trained", False), \
            mock.patch.object(cli, "_started", False), \
            mock.patch.dict(os.environ):
        yield Path(name)


def cli_outcome(argv: list[str]) -> tuple[int, str]:
    """``polytrain`` in-process: its exit code and stderr; one line with exit 2, nothing with 0."""
    err = io.StringIO()
    Recorder.specs = []
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code  # type: ignore[assignment]
    text = err.getvalue()
    if code == 0:
        assert text == "" and len(Recorder.specs) == 1, text
    else:
        assert code == 2, (code, text)
        assert text.endswith("\n") and text.count("\n") == 1 and "\r" not in text, repr(text)
        assert text.startswith(("polytrain: error: ", "polytrain train: error: ")), repr(text)
    return code, text


def write(workdir: Path, suffix: str, content: str | bytes) -> Path:
    path = workdir / f"spec{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@PROPERTY
@given(text=st.one_of(TEXT, st.binary(max_size=64)), suffix=st.sampled_from(SUFFIXES))
@example(text=f"loop: {{epochs: -{HUGE_HEX}}}\n", suffix=".yaml")
@example(text=f"seed = {HUGE_HEX}\n", suffix=".toml")
@example(text="[" * 5000, suffix=".yaml")
@example(text="[" * 5000, suffix=".json")
@example(text="a = " + "[" * 5000, suffix=".toml")
@example(text=b"\xff\xfeframework: torch", suffix=".yaml")
@example(text="model: &a {name: mlp, params: *a}\n", suffix=".yaml")
@example(text="data: {name: npz, path: \"a\\nb\"}\n", suffix=".yaml")
@pytest.mark.slow
def test_any_spec_text_loads_or_is_one_line(workdir: Path, text: str | bytes, suffix: str) -> None:
    load_outcome(write(workdir, suffix, text), [])


@PROPERTY
@given(data=SPECS, suffix=st.sampled_from(SUFFIXES))
@example(data={"data": {"name": "npz", "path": "x" * 5000}}, suffix=".yaml")
@example(data={"data": {"name": "csv", "path": "a\nb", "features": ["a"], "label": "y"}}, suffix=".json")
@example(data={"output": "\x00", "checkpoint": {"dir": "\x00"}}, suffix=".yaml")
@example(data={"a\nb": 1}, suffix=".yaml")
@example(data={"optimizer": {"lr": math.nan}}, suffix=".json")
@example(data={"reliability": {"collective_timeout_s": math.inf}}, suffix=".toml")
def test_any_structured_spec_loads_or_is_one_line(workdir: Path, data: dict[str, Any], suffix: str) -> None:
    outcome = load_outcome(write(workdir, suffix, dump(data, suffix)), [])
    if isinstance(outcome, TrainSpec):  # what loaded is what the file said, field by field
        loaded = outcome.to_dict()
        for name, value in data.items():
            if not isinstance(value, dict) and isinstance(value, (str, int)) and not isinstance(value, bool):
                assert loaded[name] == value, (name, value, loaded[name])


@PROPERTY
@given(sets=SETS)
@example(sets=[f"loop.epochs=-{HUGE_HEX}"])
@example(sets=["data.name=npz", "data.path=" + "x" * 5000])
@example(sets=["data.name=npz", "data.path=\"a\\nb\""])
@example(sets=["a\nb=1"])
@example(sets=["data=1", "data.name\n.x=1"])
@example(sets=["optimizer.lr=.nan"])
@example(sets=["reliability.startup_timeout_s=.inf"])
def test_any_set_loads_or_is_one_line(workdir: Path, sets: list[str]) -> None:
    load_outcome(None, sets)


@PROPERTY
@given(data=SPECS, suffix=st.sampled_from(SUFFIXES), sets=SETS)
@example(data={}, suffix=".yaml", sets=["--set", "-x"])
@example(data={"loop": 3}, suffix=".yaml", sets=["loop.epochs=2"])
@pytest.mark.slow
def test_the_cli_exits_0_or_2_with_one_line(workdir: Path, data: dict[str, Any], suffix: str,
                                            sets: list[str]) -> None:
    path = write(workdir, suffix, dump(data, suffix))
    code, _ = cli_outcome(["train", "--quiet", str(path), *[a for s in sets for a in ("--set", s)]])
    assert code == (0 if isinstance(load_outcome(path, sets), TrainSpec) else 2)


@pytest.mark.parametrize("sets, message", [
    # inputs the properties above once found ending in a traceback or a message of several lines
    ([f"loop.epochs=-{HUGE_HEX}"], "--set loop.epochs: an integer of 16000 bits is too large to be a spec value"),
    (["seed=" + "9" * 5000], "--set seed: cannot parse value '999"),
    (["data.name=npz", "data.path=" + "x" * 5000], "data.path: file not found: xxx"),
    (["data.name=npz", 'data.path="a\\nb"'], "data.path: file not found: 'a\\nb'"),
    (['data={"a\\nb": 1}'], "data.'a\\nb': unknown field"),
    (["optimizer.lr=.nan"], "optimizer.lr: expected a finite number, got nan"),
    (["reliability.collective_timeout_s=.inf"], "reliability.collective_timeout_s: expected a finite number, got inf"),
    (["optimizer.lr=" + "9" * 400], "optimizer.lr: expected a finite number, got 999"),
])
def test_found_inputs_end_in_a_line_naming_the_field(sets: list[str], message: str) -> None:
    outcome = load_outcome(None, sets)
    assert isinstance(outcome, str) and outcome.startswith(message), outcome[:300]


def test_a_huge_integer_in_a_file_names_the_file(workdir: Path) -> None:
    path = write(workdir, ".toml", f"seed = {HUGE_HEX}\n")
    assert load_outcome(path, []) == f"{path}: an integer of 16000 bits is too large to be a spec value"

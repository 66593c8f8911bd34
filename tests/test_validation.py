"""Loading a spec whole (`polytrain.validation`): the spec module parses, the validation module holds the parsed
spec to the rules across fields and to the registry's tables, and the data sources' names are the registry's."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from test_structure import import_graph

from polytrain import registry, validation
from polytrain.errors import SpecError
from polytrain.spec import tables as spec

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code, ``TYPE_CHECKING`` blocks included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_the_spec_module_imports_neither_the_registry_nor_the_validation() -> None:
    direct = set().union(*(_imports(path) for path in (REPO / "polytrain" / "spec").glob("*.py")))
    assert not {"polytrain.registry", "polytrain.validation"} & direct
    graph, reached, todo = import_graph(), set(), ["polytrain.spec.tables"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert not {"polytrain.registry", "polytrain.validation"} & reached
    assert "polytrain.validation" not in _imports(REPO / "polytrain" / "registry.py")
    assert {"polytrain.spec.tables", "polytrain.registry"} <= graph["polytrain.validation"]


def test_data_name_takes_the_registry_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SpecError) as refused:
        validation.from_dict({"data": {"name": "toy"}})
    assert str(refused.value) == f"data.name: 'toy' is not allowed (allowed: {', '.join(registry.source_names())})"
    assert registry.source_names() == tuple(row.name for row in registry.SOURCES)

    toy = registry.SourceEntry("toy", "toy_source:open_toy", uses=("path",))
    monkeypatch.setattr(registry, "SOURCES", (*registry.SOURCES, toy))
    assert validation.from_dict({"data": {"name": "toy"}}).data.name == "toy"
    with pytest.raises(SpecError, match=r"^data\.tokens: only used with data\.name tokens, not 'toy'$"):
        validation.from_dict({"data": {"name": "toy", "tokens": {"samples": 64}}})


def test_an_unknown_data_name_is_found_where_the_file_has_it() -> None:
    """data.name is checked while the spec is built, as a field's own choices are: the first bad field in the
    file's order is the one named."""
    bad_name, bad_lr = {"data": {"name": "mnist"}}, {"optimizer": {"lr": -1}}
    with pytest.raises(SpecError, match=r"^data\.name: 'mnist' is not allowed"):
        validation.from_dict({**bad_name, **bad_lr})
    with pytest.raises(SpecError, match=r"^optimizer\.lr: -1\.0 is out of range"):
        validation.from_dict({**bad_lr, **bad_name})


def test_parse_checks_each_field_and_validation_the_rest() -> None:
    raw = {"optimizer": {"name": "adam", "nesterov": True}, "model": {"name": "no_such_model"}}
    parsed = spec.parse(raw, data_sources=registry.source_names())
    assert (parsed.optimizer.nesterov, parsed.model.name) == (True, "no_such_model")
    with pytest.raises(SpecError, match=r"^optimizer\.nesterov: needs optimizer\.name 'sgd'"):
        validation.check(parsed)
    fixed = dataclasses.replace(parsed, optimizer=spec.OptimizerSpec(name="adam"))
    validation.check(fixed, validate_components=False)
    with pytest.raises(SpecError, match=r"^model\.name: "):
        validation.check(fixed)
    with pytest.raises(SpecError, match=r"^data\.name: 'digits' is not allowed \(allowed: csv\)$"):
        spec.parse({"data": {"name": "digits"}}, data_sources=("csv",))

"""The shape of polytrain's own modules (polytrain/, adapters/, launchers/): no import cycle, none too long.

Read with ``ast``, so nothing is imported: every ``import``/``from ... import`` counts, also one inside a
function (a lazy import hides a cycle from the interpreter, not from a reader) and one under
``if TYPE_CHECKING:`` (it never runs, yet its module knows the other's types: the two still depend on each
other). ``from package import module`` is an edge to that module; a submodule's implicit import of its parent
package is not an edge.

The package root (``polytrain/*.py``) holds the public face only (`PUBLIC_FACE`); every other concern is a
package (docs/DESIGN.md, Layout).
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"polytrain": REPO / "polytrain", "polytrain.adapters": REPO / "adapters",
         "polytrain.launchers": REPO / "launchers"}
#: the modules of the package root: the public face (docs/DESIGN.md, Layout). Every other concern is a package; a
#: new root module is a change of that face, made here on purpose
PUBLIC_FACE = {"__init__", "api", "cli", "errors", "world", "registry", "validation", "protocols", "version",
               "callbacks", "compare"}


def module_files() -> dict[str, Path]:
    mods = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = module_files()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = imported(ast.parse(path.read_text(), str(path)), package, mods)
        graph[name] = {o for t in targets if t.startswith("polytrain") and (o := owner(t)) and o != name}
    return graph


def imported(tree: ast.AST, package: str, mods: Collection[str]) -> list[str]:
    """Every name a module's ``tree`` imports (in ``package``): at module level, inside functions, under
    ``if TYPE_CHECKING:`` alike; ``from a import b`` names ``a.b`` where that is a module of ``mods``."""
    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_graph_covers_every_module() -> None:
    graph = import_graph()
    assert {"polytrain.spec.tables", "polytrain.adapters.torch.ddp", "polytrain.launchers.torchrun"} <= graph.keys()
    assert "polytrain.spec.tables" in graph["polytrain.train.trainer"]


def test_every_import_counts_lazy_and_type_checking_alike() -> None:
    tree = ast.parse("import polytrain.a\n"
                     "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from polytrain.b import B\n"
                     "def f():\n    from . import c\n    from .d import D\n")
    mods = {"polytrain.a", "polytrain.b", "polytrain.pkg.c", "polytrain.pkg.d"}
    assert set(imported(tree, "polytrain.pkg", mods)) == {"polytrain.a", "typing", "polytrain.b", "polytrain.pkg.c",
                                                          "polytrain.pkg.d"}


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_modules_stay_small() -> None:
    """A module a reader can hold in their head: at most 400 lines."""
    long = {name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_the_root_holds_the_public_face_only() -> None:
    """A concern of its own is a package, not one more module at the root (add to `PUBLIC_FACE` on purpose)."""
    root = {path.stem for path in ROOTS["polytrain"].glob("*.py")}
    assert root - PUBLIC_FACE == set(), (f"modules at the package root beyond its public face: "
                                         f"{sorted(root - PUBLIC_FACE)}; put them in the package of their concern")


#: modules that work on other objects' state and must take it through what those objects hand over (the own loops'
#: `polytrain.loop.checkpoints.LoopState`, the Trainer's adapters), never through their private fields
HANDED_STATE = ("polytrain.checkpoint", "polytrain.loop", "polytrain.train", "polytrain.torch.checkpoints",
                "polytrain.tensorflow.checkpoints")


def private_reads(tree: ast.AST) -> list[str]:
    """``x._field`` where ``x`` is not ``self`` or ``cls`` (dunders aside): reading another object's private field."""
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_the_checkpoint_code_reads_no_private_field() -> None:
    assert private_reads(ast.parse("dist._model\nself._model\ndist.backend\nx.__class__\ndist._owner = o\n")) == [
        "dist._model", "dist._owner"]
    found = {name: reads for name, path in module_files().items() if name.startswith(HANDED_STATE)
             and (reads := private_reads(ast.parse(path.read_text())))}
    assert not found, f"private fields of other objects read: {found}"


def defined_names(tree: ast.Module) -> set[str] | None:
    """The names a module defines at its top level (inside top-level ``if``/``try`` too); None where it makes names
    on demand (``__getattr__``, a star import, ``globals()``)."""
    if any(isinstance(n, ast.Name) and n.id == "globals" for n in ast.walk(tree)) or any(
            isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)):
        return None
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            body += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_every_name_imported_from_the_package_exists() -> None:
    """A ``from polytrain.x import name`` anywhere in the package, its tests, benches and examples, at module level
    or inside a function, names a module that exists and a name it defines: a lazy import that a move left behind
    fails here, not in the one run that reaches it."""
    mods = module_files()
    defined = {name: defined_names(ast.parse(path.read_text(), str(path))) for name, path in mods.items()}
    files = [*mods.values(), *(p for d in ("tests", "bench", "examples") for p in (REPO / d).rglob("*.py"))]
    missing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("polytrain"):
                continue
            if node.module not in mods:
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}: no module {node.module}")
                continue
            names = defined[node.module]
            for alias in node.names:
                if names is not None and alias.name != "*" and alias.name not in names \
                        and f"{node.module}.{alias.name}" not in mods:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module} has no {alias.name}")
    assert not missing, "\n".join(missing)

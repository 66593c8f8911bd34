"""The torch backend contract (adapters/torch/contract.py): declared once, every member documented, met by every
torch backend the registry makes, and read by its two clients (the Trainer's `TorchFramework`, the own loop) through
flags, never through a backend's name; the registry says which backends the own loop drives."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from polytrain import registry  # noqa: E402
from polytrain.adapters.torch.contract import TorchBackendContract  # noqa: E402
from polytrain.adapters.torch.local import LocalBackend  # noqa: E402
from polytrain.adapters.torch.parallel.backend import ParallelBackend  # noqa: E402
from polytrain.spec.tables import TrainSpec  # noqa: E402
from polytrain.world import World  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
#: where the two torch clients and the precision component live
CLIENTS = [ROOT / "adapters/torch/framework.py", ROOT / "adapters/torch/precision.py",
           *sorted((ROOT / "polytrain/torch").glob("*.py"))]
#: the contract's protocol classes: (file, class)
DECLARED = [(ROOT / "polytrain/protocols.py", "Backend"), (ROOT / "adapters/torch/contract.py", "TorchBackendContract")]


def members(path: Path, name: str) -> dict[str, bool]:
    """The members a protocol class declares → whether each is documented (a method's docstring, an attribute's
    ``#:`` comment on the line above)."""
    lines = path.read_text().splitlines()
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    out = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            out[item.name] = bool(ast.get_docstring(item))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out[item.target.id] = lines[item.lineno - 2].strip().startswith("#:")
    return out


def contract_members() -> dict[str, bool]:
    return {k: v for path, name in DECLARED for k, v in members(path, name).items()}


def torch_backend_classes() -> list[type]:
    classes = [ParallelBackend]
    for entry in registry.backends_for("torch").values():
        if entry.unusable_reason() is None:
            module, _, cls = entry.target.partition(":")
            classes.append(getattr(importlib.import_module(module), cls))
    return classes


def test_every_member_of_the_contract_is_declared_and_documented() -> None:
    declared = contract_members()
    assert len(declared) >= 36, sorted(declared)  # the whole of what the clients call, not a sample
    assert [name for name, documented in declared.items() if not documented] == []


def test_every_torch_backend_meets_the_contract_with_its_signatures() -> None:
    spec = TrainSpec()
    assert isinstance(LocalBackend(spec, World()), TorchBackendContract)
    instance_fields = set(vars(LocalBackend(spec, World())))  # what the base's __init__ sets
    for cls in torch_backend_classes():
        missing = [m for m in contract_members() if not hasattr(cls, m) and m not in instance_fields]
        assert missing == [], (cls.__name__, missing)
        for name in contract_members():
            wanted = getattr(TorchBackendContract, name, None)
            if inspect.isfunction(wanted):
                got = list(inspect.signature(getattr(cls, name)).parameters)
                assert got == list(inspect.signature(wanted).parameters), (cls.__name__, name, got)


def test_what_deepspeed_does_itself_is_said_through_the_contract() -> None:
    pytest.importorskip("deepspeed")
    from polytrain.adapters.torch.deepspeed import DeepSpeedBackend

    flags = ("weights_in_precision", "clips_in_step", "owns_loss_scaler")
    assert [getattr(DeepSpeedBackend, f) for f in flags] == [True, True, True]
    assert [getattr(LocalBackend, f) for f in flags] == [False, False, False]


def test_the_torch_clients_never_ask_a_backend_its_name() -> None:
    names = "|".join(re.escape(b) for b in registry.all_backend_names())
    asking = re.compile(rf"backend\.name\s*(==|!=|in\b|not in\b)|==\s*[\"'](?:{names})[\"']|[\"'](?:{names})[\"']\s*==")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in CLIENTS
             for n, line in enumerate(path.read_text().splitlines(), 1) if asking.search(line)]
    assert found == []


def test_the_update_sequence_has_one_home() -> None:
    """Autocast, unscaling and the loss scaler's step are written in the precision component only."""
    sequence = re.compile(r"torch\.autocast\(|\.unscale_\(|\.get_scale\(|scaler\.step\b")
    torch_code = [*sorted((ROOT / "adapters/torch").rglob("*.py")), *sorted((ROOT / "polytrain/torch").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in torch_code if path.name != "precision.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if sequence.search(line)]
    assert found == []


def test_the_registry_says_which_backends_the_own_loop_drives(monkeypatch: pytest.MonkeyPatch) -> None:
    from polytrain.torch import Distributed, OwnLoopError

    assert registry.own_loop_backends("torch") == ("local", "ddp", "fsdp", "deepspeed", "horovod", "mpi")
    assert registry.own_loop_backends("tensorflow") == ("local", "tf-multiworker", "horovod", "mpi")
    rows = tuple(dataclasses.replace(b, own_loop=False) if (b.name, b.framework) == ("local", "torch") else b
                 for b in registry.BACKENDS)
    monkeypatch.setattr(registry, "BACKENDS", rows)
    with pytest.raises(OwnLoopError, match=r"^backend: 'local' is not in the own-loop API yet \(it takes ddp, fsdp, "
                                           r"deepspeed, horovod, mpi\)$"):
        Distributed("local")

"""Activation checkpointing and torch.compile from the spec, in one process on each PyTorch backend.

Checkpointing: the layers inside each declared block run twice per micro-step (forward, then the
recomputation in the backward pass), the layers outside the blocks once, on every backend; the
activations kept for the backward pass shrink; names and state dicts stay those of the plain model.
Compile: the module each backend names is compiled in place (see adapters/torch/execution.py).
The spec rules: PyTorch-only, compile.mode needs compile.enabled, blocks must exist, digests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import check, loopback_env, run
from specs import lm

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from polytrain import registry, validation  # noqa: E402
from polytrain.adapters.torch.execution import block_modules, checkpoint_blocks, is_checkpointed  # noqa: E402
from polytrain.adapters.torch.transformer import TransformerLM  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec import tables as spec_mod  # noqa: E402
from polytrain.spec.zoo import TransformerParams  # noqa: E402

LM = lm(tokens=None, d_model=16, n_heads=2, dropout=0.1)
WORKER = Path(__file__).with_name("execution_worker.py")
#: what each backend compiles in place: its wrapper (DDP), the model, or the model and every unit (FSDP2)
COMPILED = {"local": (False, True, False), "ddp": (True, False, False), "fsdp": (False, True, True),
            "deepspeed": (False, True, False), "horovod": (False, True, False), "mpi": (False, True, False)}


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.slow
def test_every_backend_recomputes_the_blocks_and_compiles_in_place(backend: str, tmp_path: Path) -> None:
    """On each backend (one process of its own): with checkpointing the layers inside each block run twice
    per micro-step (forward, then recomputed in the backward pass), the head once; without, once each.
    Names stay the plain model's; compile wraps the module the backend names, in place."""
    reason = registry.backends_for("torch")[backend].unusable_reason()
    if reason:
        pytest.skip(reason)
    result = check(run([sys.executable, str(WORKER), backend, str(tmp_path)], timeout=240,
                       env=loopback_env(PYTHONPATH=str(WORKER.parents[2]))))  # the worker imports tests/specs.py
    report = json.loads(next(line[7:] for line in result.stdout.splitlines() if line.startswith("REPORT ")))
    plain = [n for n, _ in TransformerLM(16, 8, TransformerParams(16, 2, 2)).named_parameters()]
    for checkpointing, calls in ((False, 1), (True, 2)):
        built = report[f"checkpointing={checkpointing}"]
        assert built["names"] == plain
        assert built["checkpointed"] == [checkpointing] * 2
        assert built["calls"] == {"blocks.0.mlp.fc": calls, "blocks.1.mlp.fc": calls, "head": 1}
    compiled = report["compiled"]
    wrapper, model, units = COMPILED[backend]
    assert (compiled["wrapper"], compiled["model"], compiled["blocks"]) == (wrapper, model, [units] * 2)
    assert compiled["state"] == sorted({*plain, "head.weight"})  # in place: no _orig_mod. prefix


def saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass (parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).sum()
    loss.backward()
    return sum(seen.values())


@pytest.mark.slow
def test_checkpointing_keeps_fewer_activations_and_the_same_gradients() -> None:
    params = TransformerParams(d_model=32, n_heads=4, n_layers=4, dropout=0.1)
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, 64, size=(8, 32)))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(64, 32, params)
        if checkpointing:
            assert len(checkpoint_blocks(validation.from_dict({**LM, "activation_checkpointing": True}), model)) == 4
        torch.manual_seed(1)  # the same dropout masks: the recomputation replays the forward's RNG state
        results.append((saved_bytes(model, tokens), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (off, grads_off), (on, grads_on) = results
    assert on < 0.5 * off, f"checkpointing kept {on} of {off} bytes"
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=0, atol=0, msg=name)


def test_nested_blocks_are_checkpointed_once() -> None:
    spec = validation.from_dict({**LM, "backend": "fsdp", "fsdp": {"units": ["Block", "MLPBlock"]},
                                 "activation_checkpointing": True}, validate_components=False)
    model = TransformerLM(16, 8, TransformerParams(16, 2, 2))
    assert len(block_modules(model, ("Block", "MLPBlock"))) == 4
    assert checkpoint_blocks(spec, model) == list(model.blocks)
    assert not any(is_checkpointed(b.mlp) for b in model.blocks)


def test_model_without_blocks_is_refused_in_one_line() -> None:
    spec = validation.from_dict({"activation_checkpointing": True, "model": {"name": "tests:factory"}},
                                validate_components=False)
    with pytest.raises(SpecError, match=r"^activation_checkpointing: the model declares no blocks to checkpoint; "
                                        r"give the model a block_classes attribute"):
        checkpoint_blocks(spec, nn.Sequential(nn.Linear(2, 2)))


# ---------------------------------------------------------------- spec rules
def test_new_fields_default_off_and_leave_the_model_digest_alone() -> None:
    plain = validation.from_dict(LM)
    assert not plain.activation_checkpointing and plain.compile == spec_mod.CompileSpec(False, "default")
    on = validation.from_dict({**LM, "activation_checkpointing": True,
                               "compile": {"enabled": True, "mode": "max-autotune"}})
    assert on.model_digest() == plain.model_digest()  # checkpoints move between eager/compiled, with/without
    assert on.digest() != plain.digest()  # but they are part of the run's description (ranks must agree)


@pytest.mark.parametrize(("fields", "message"), [
    ({"framework": "tensorflow", "activation_checkpointing": True},
     "activation_checkpointing: PyTorch-only; framework 'tensorflow' has no equivalent here"),
    ({"framework": "tensorflow", "compile": {"enabled": True}},
     "compile.enabled: torch.compile is PyTorch-only; framework 'tensorflow' already runs"),
    ({"compile": {"mode": "max-autotune"}}, "compile.mode: only used with compile.enabled: true"),
    ({"compile": {"enabled": True, "mode": "fast"}}, "compile.mode: 'fast' is not allowed"),
    ({"activation_checkpointing": True, "model": {"name": "mlp"}, "data": {"name": "digits"}},
     "activation_checkpointing: model 'mlp' declares no blocks to checkpoint"),
    ({"backend": "fsdp", "fsdp": {"activation_checkpointing": True}, "model": {"name": "convnet"},
      "data": {"name": "digits"}},
     "fsdp.activation_checkpointing: model 'convnet' declares no blocks to checkpoint"),
])
def test_spec_rules_are_one_line(fields: dict, message: str) -> None:
    raw = {**LM, **fields}
    with pytest.raises(SpecError) as info:
        validation.from_dict(raw, validate_components=False)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_fsdp_alias_and_named_units_are_allowed() -> None:
    alias = validation.from_dict({**LM, "backend": "fsdp", "fsdp": {"activation_checkpointing": True}})
    mlp_units = validation.from_dict({"backend": "fsdp", "activation_checkpointing": True,
                                      "fsdp": {"units": ["Linear"]}})
    from polytrain.adapters.torch.execution import checkpointing_on

    assert checkpointing_on(alias) and checkpointing_on(mlp_units)


@pytest.mark.parametrize("field", ["activation_checkpointing=true", "compile.enabled=true"])
def test_tensorflow_with_torch_only_fields_exits_2_in_one_line(field: str, tmp_path: Path) -> None:
    result = run([sys.executable, "-m", "polytrain.cli", "train", "--set", "framework=tensorflow", "--set", field,
                  "--set", f"output={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "PyTorch-only" in result.stderr
    assert result.stderr.startswith(f"polytrain: error: {field.partition('=')[0]}: ")

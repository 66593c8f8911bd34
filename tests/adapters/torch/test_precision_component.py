"""The precision component (adapters/torch/precision.py) in one process, on the real local backend: what a backend
says it does itself (the contract's flags) decides the input cast, the clipping and who owns the fp16 loss scaler.
The component through both clients: test_fp16_scaling.py (the Trainer's adapter), tests/torch (the own loop),
tests/multiproc/test_precision.py and test_own_loop.py (across ranks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch.local import LocalBackend  # noqa: E402
from polytrain.adapters.torch.precision import Precision  # noqa: E402
from polytrain.world import World  # noqa: E402


def backend(precision: str, **flags: bool) -> LocalBackend:
    made = LocalBackend(validation.from_dict({"precision": precision}), World())
    for name, value in flags.items():
        setattr(made, name, value)
    return made


def model_with_grads() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(8, 4)).pow(2).sum().mul(100).backward()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def grad_norm(model: torch.nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def test_inputs_are_cast_only_for_a_backend_whose_weights_are_in_the_precision() -> None:
    x, labels = torch.randn(2, 4), torch.tensor([1, 2])
    cast = Precision(backend("bf16", weights_in_precision=True).spec, backend("bf16", weights_in_precision=True))
    assert cast.convert_input(x).dtype == torch.bfloat16 and cast.convert_input(labels).dtype == torch.int64
    assert Precision(backend("bf16").spec, backend("bf16")).convert_input(x).dtype == torch.float32
    fp32 = backend("fp32", weights_in_precision=True)
    assert Precision(fp32.spec, fp32).convert_input(x).dtype == torch.float32


def test_the_own_loops_forward_takes_fp32_inputs_into_bf16_weights_and_returns_fp32() -> None:
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    for flags, given in (({"weights_in_precision": True}, torch.bfloat16), ({}, torch.float32)):
        seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

        def forward(x: torch.Tensor, *, scale: torch.Tensor, seen: list = seen) -> torch.Tensor:
            seen.append((x.dtype, scale.dtype, torch.is_autocast_enabled("cpu")))
            return model(x.to(torch.bfloat16)) * scale

        made = backend("bf16", **flags)
        out = Precision(made.spec, made).forward(forward)(torch.randn(2, 4), scale=torch.ones(()))
        assert seen == [(given, given, True)] and out.dtype == torch.float32
    fp32 = backend("fp32", weights_in_precision=True)
    assert Precision(fp32.spec, fp32).forward(model.forward) == model.forward  # fp32: the forward itself


def test_a_backend_that_clips_in_its_step_is_not_asked_to_clip() -> None:
    model, optimizer = model_with_grads()
    before = grad_norm(model)
    assert before > 1.0
    own = backend("fp32", clips_in_step=True)
    assert Precision(own.spec, own).clip(model, optimizer, 1.0) is None and grad_norm(model) == before
    plain = backend("fp32")
    assert Precision(plain.spec, plain).clip(model, optimizer, 1.0) == pytest.approx(before)
    assert grad_norm(model) == pytest.approx(1.0, rel=1e-4)


def test_fp16_asks_the_backend_for_a_scaler_unless_it_owns_one() -> None:
    class NoScaler(LocalBackend):
        def grad_scaler(self) -> None:
            raise AssertionError("a backend that owns its loss scaler was asked for one")

        def loss_scale(self) -> float:
            return 8.0

    owner = NoScaler(validation.from_dict({"precision": "fp16"}), World())
    owner.owns_loss_scaler = True
    precision = Precision(owner.spec, owner)
    assert precision.scaler is None and precision.loss_scale() == 8.0 and precision.state_dict() is None
    assert precision.stats() == {"skipped_steps": 0.0, "loss_scale": 8.0}
    for name in ("fp32", "bf16"):
        assert Precision(backend(name).spec, backend(name)).scaler is None


def test_checks_finite_is_told_to_the_backend_before_wrap() -> None:
    made = backend("fp32")
    assert Precision(made.spec, made, checks_finite=True).checks_finite and made.checks_finite
    assert not Precision(made.spec, made).checks_finite and not made.checks_finite

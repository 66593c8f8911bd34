"""The TensorFlow adapter on one process: accumulation, clipping, state in and out, optimizer state, bf16."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from polytrain import registry, validation  # noqa: E402
from polytrain.adapters.tensorflow.framework import StateMismatchError  # noqa: E402
from polytrain.data import load_dataset  # noqa: E402
from polytrain.world import World  # noqa: E402

BASE = {"model": {"name": "mlp", "params": {"hidden_sizes": [32, 16]}}, "data": {"name": "digits"}}


def make(framework: str = "tensorflow", **raw: object):
    spec = validation.from_dict({**BASE, **raw, "framework": framework})
    data = load_dataset(spec.data, spec.seed)
    backend = registry.create_backend(spec, World())
    backend.setup()
    fw = registry.create_framework(spec, World(), backend)
    fw.build(data.info)
    return fw, data


@pytest.fixture(scope="module")
def digits():
    return load_dataset(validation.from_dict(BASE).data, 0)


@pytest.mark.slow
def test_two_micro_steps_accumulate_like_one_big_one(digits) -> None:
    x, y = digits.x_train[:32], digits.y_train[:32]
    fw, _ = make()
    big_loss = fw.train_micro_step(x, y, 1 / 32, sync=True)
    big = [a.numpy().copy() for a in fw.accumulators]
    fw.optimizer_step(0.0, None)  # lr 0: only zeroes the accumulators
    assert all(not a.numpy().any() for a in fw.accumulators)
    halves = fw.train_micro_step(x[:16], y[:16], 1 / 32, sync=False) + fw.train_micro_step(x[16:], y[16:], 1 / 32,
                                                                                           sync=True)
    assert halves == pytest.approx(big_loss, rel=1e-6)  # summed, not averaged, losses
    for a, b in zip(fw.accumulators, big):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-7)


def test_clipping_and_steps_match_pytorch(digits) -> None:
    raw = {"optimizer": {"name": "adam", "lr": 0.01}}
    tf_fw, _ = make(**raw)
    torch_fw, _ = make("torch", **raw)
    tf_fw.load_state(torch_fw.export_state())
    x, y = digits.x_train[:64], digits.y_train[:64]
    for step in range(3):
        batch = slice(16 * step, 16 * step + 16)
        losses = [fw.train_micro_step(x[batch], y[batch], 1 / 16, sync=True) for fw in (tf_fw, torch_fw)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        norms = [fw.optimizer_step(0.01, 0.1) for fw in (tf_fw, torch_fw)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0.1  # the clip was active
    mine, theirs = tf_fw.export_state(), torch_fw.export_state()
    for name in theirs:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert tf_fw.optimizer_step(0.01, None) is None


def test_optimizer_state_moves_between_frameworks(digits) -> None:
    raw = {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}
    torch_fw, _ = make("torch", **raw)
    for i in range(2):
        torch_fw.train_micro_step(digits.x_train[i * 8:i * 8 + 8], digits.y_train[i * 8:i * 8 + 8], 1 / 8, True)
        torch_fw.optimizer_step(0.1, None)
    tf_fw, _ = make(**raw)
    assert tf_fw.export_optimizer_state() == {}  # like torch.optim before its first step
    tf_fw.load_state(torch_fw.export_state())
    tf_fw.load_optimizer_state(torch_fw.export_optimizer_state())
    exported, torch_opt = tf_fw.export_optimizer_state(), torch_fw.export_optimizer_state()
    assert set(exported) == set(torch_opt) and "hidden.0.weight/momentum_buffer" in exported
    for key in torch_opt:
        np.testing.assert_array_equal(exported[key], torch_opt[key])
    for fw in (tf_fw, torch_fw):  # resumed in TensorFlow, training goes on as in PyTorch
        fw.train_micro_step(digits.x_train[16:24], digits.y_train[16:24], 1 / 8, True)
        fw.optimizer_step(0.1, None)
    for name, value in torch_fw.export_state().items():
        np.testing.assert_allclose(tf_fw.export_state()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_load_state_names_the_mismatch() -> None:
    fw, _ = make()
    state = fw.export_state()
    with pytest.raises(StateMismatchError, match=r"missing: head.bias; unexpected: -"):
        fw.load_state({k: v for k, v in state.items() if k != "head.bias"})
    with pytest.raises(StateMismatchError, match=r"head.weight has shape \(10, 3\), the model needs \(10, 16\)"):
        fw.load_state({**state, "head.weight": np.zeros((10, 3), np.float32)})
    with pytest.raises(StateMismatchError, match="optimizer state for unknown parameter 'nope'"):
        fw.load_optimizer_state({"nope/momentum_buffer": np.zeros(3)})


def test_rng_state_round_trips() -> None:
    fw, _ = make()
    state = fw.rng_state()
    assert len(state) == 2 and all(isinstance(v, int) for v in state)
    fw.set_rng_state([7, 3])
    assert fw.rng_state() == [7, 3]


@pytest.mark.slow
def test_bf16_trains_like_fp32(digits) -> None:
    results = {}
    for precision in ("fp32", "bf16"):
        fw, _ = make(precision=precision, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})
        loss0 = fw.evaluate(digits.x_val, digits.y_val)["loss"][0]
        for i in range(30):
            idx = slice(32 * i, 32 * i + 32)
            fw.train_micro_step(digits.x_train[idx], digits.y_train[idx], 1 / 32, sync=True)
            fw.optimizer_step(0.1, None)
        (loss, count), (correct, _) = fw.evaluate(digits.x_val, digits.y_val).values()
        assert count == len(digits.y_val) and loss < 0.8 * loss0, precision
        results[precision] = loss
        assert {v.dtype for v in fw.model.trainable_variables} == {"float32"}
    assert results["bf16"] != results["fp32"]  # it really computed in bfloat16 ...
    assert results["bf16"] == pytest.approx(results["fp32"], rel=0.1)  # ... and learned alike


def test_empty_micro_batch_adds_nothing(digits) -> None:
    fw, _ = make(model={"name": "convnet", "params": {"channels": [4]}})
    x, y = digits.x_train[:8], digits.y_train[:8]
    fw.train_micro_step(x, y, 1 / 8, sync=False)
    before = [a.numpy().copy() for a in fw.accumulators]
    assert fw.train_micro_step(x[:0], y[:0], 1 / 8, sync=True) == 0.0
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(fw.accumulators, before))
    assert fw.evaluate(x[:0], y[:0]) == {"loss": (0.0, 0.0), "accuracy": (0.0, 0.0)}


def test_nonfinite_gradients_are_seen_and_discarded(digits) -> None:
    fw, _ = make()
    x, y = digits.x_train[:8], digits.y_train[:8]
    fw.train_micro_step(x, y, 1 / 8, sync=True)
    assert fw.grads_finite()
    fw.train_micro_step(x, y, float("inf"), sync=True)
    assert not fw.grads_finite()
    before = fw.export_state()
    fw.discard_gradients()
    assert fw.grads_finite() and all(not a.numpy().any() for a in fw.accumulators)
    assert all(np.array_equal(v, fw.export_state()[k]) for k, v in before.items())


def test_parameter_shapes_are_the_portable_ones() -> None:
    fw, _ = make(model={"name": "convnet", "params": {"channels": [4], "kernel_size": 5}})
    assert fw.parameter_shapes() == {"conv.0.weight": (4, 1, 5, 5), "conv.0.bias": (4,), "head.weight": (10, 64),
                                     "head.bias": (10,)}

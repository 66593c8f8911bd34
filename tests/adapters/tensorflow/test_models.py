"""Keras zoo models: PyTorch's names, shapes, initial distributions and forward pass; user factories."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from polytrain.adapters.tensorflow.models import (  # noqa: E402
    CONV_KERNEL,
    DENSE_KERNEL,
    build_model,
    from_portable,
    to_portable,
)
from polytrain.adapters.torch.models import build_model as build_torch_model  # noqa: E402
from polytrain.data.source import DatasetInfo  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402

DIGITS = DatasetInfo(input_shape=(64,), num_outputs=10, task="classification", image_shape=(1, 8, 8))
CASES = [
    ("mlp", {"hidden_sizes": [48, 24], "activation": "relu"}),
    ("mlp", {"hidden_sizes": [16], "activation": "gelu"}),
    ("convnet", {"channels": [4, 8], "kernel_size": 3, "activation": "tanh"}),
    ("convnet", {"channels": [6], "kernel_size": 5, "activation": "gelu"}),
]


def tf_state(name: str, params: dict, seed: int = 0, precision: str = "fp32") -> dict[str, np.ndarray]:
    _, entries = build_model(name, params, DIGITS, seed=seed, precision=precision)
    return {e.name: to_portable(e.variable.numpy(), e.layout) for e in entries}


@pytest.mark.parametrize(("name", "params"), CASES)
def test_names_and_shapes_are_pytorchs(name: str, params: dict) -> None:
    torch_state = build_torch_model(name, params, DIGITS).state_dict()
    mine = tf_state(name, params)
    assert {k: v.shape for k, v in mine.items()} == {k: tuple(v.shape) for k, v in torch_state.items()}


@pytest.mark.parametrize(("name", "params"), CASES[:1] + CASES[2:3])
def test_initial_values_follow_pytorchs_default_distribution(name: str, params: dict) -> None:
    state = tf_state(name, params)
    for key, value in state.items():
        weight = state[key.replace(".bias", ".weight")]
        fan_in = int(np.prod(weight.shape[1:]))
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(value).max() <= bound, key
        if value.size >= 500:  # U(-b, b): standard deviation b/√3, max near b
            assert value.std() == pytest.approx(bound / math.sqrt(3), rel=0.1), key
            assert np.abs(value).max() > 0.95 * bound, key
    again, other = tf_state(name, params), tf_state(name, params, seed=1)
    assert all(np.array_equal(state[k], again[k]) for k in state)  # the seed fixes them, on every rank
    assert not np.array_equal(state["head.weight"], other["head.weight"])


@pytest.mark.parametrize(("name", "params"), CASES)
def test_same_state_same_outputs_as_pytorch(name: str, params: dict) -> None:
    torch_model = build_torch_model(name, params, DIGITS).eval()
    model, entries = build_model(name, params, DIGITS, seed=0, precision="fp32")
    for e in entries:
        e.variable.assign(from_portable(torch_model.state_dict()[e.name].numpy(), e.layout))
    x = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_layouts_are_pytorchs_and_round_trip() -> None:
    kernel = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # Keras (kh, kw, in, out)
    portable = to_portable(kernel, CONV_KERNEL)
    assert portable.shape == (5, 4, 2, 3) and portable[4, 3, 1, 2] == kernel[1, 2, 3, 4]
    assert np.array_equal(from_portable(portable, CONV_KERNEL), kernel)
    dense = np.arange(6, dtype=np.float32).reshape(2, 3)  # Keras (in, out)
    assert np.array_equal(to_portable(dense, DENSE_KERNEL), dense.T)
    assert np.array_equal(from_portable(dense.T, DENSE_KERNEL), dense)


def test_bf16_computes_in_bfloat16_with_float32_variables() -> None:
    model, entries = build_model("convnet", {"channels": [4]}, DIGITS, seed=0, precision="bf16")
    assert model(np.zeros((2, 64), np.float32)).dtype == tf.bfloat16
    assert {e.variable.dtype for e in entries} == {"float32"}


def test_convnet_needs_images() -> None:
    flat = DatasetInfo(input_shape=(10,), num_outputs=2, task="classification")
    with pytest.raises(SpecError, match="model.name: 'convnet' needs image data"):
        build_model("convnet", {}, flat, seed=0, precision="fp32")


def test_users_keras_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_keras_models.py").write_text(textwrap.dedent("""\
        import keras

        def make(info, width=8):
            return keras.Sequential([keras.Input(info.input_shape), keras.layers.Dense(width, name="body"),
                                     keras.layers.Dropout(0.1), keras.layers.Dense(info.num_outputs, name="out")])

        def not_a_model(info):
            return object()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, entries = build_model("my_keras_models:make", {"width": 5}, DIGITS, seed=0, precision="bf16")
    names = [e.name for e in entries]
    assert names == [v.path for v in model.variables if v.name != "seed_generator_state"] and len(names) == 4
    assert entries[0].variable.shape == (64, 5)  # a user's model keeps Keras' layout under its own names
    assert model(np.zeros((1, 64), np.float32)).dtype == tf.bfloat16  # the global policy reached its layers
    with pytest.raises(SpecError, match="model.name: my_keras_models:not_a_model returned object, not a keras.Model"):
        build_model("my_keras_models:not_a_model", {}, DIGITS, seed=0, precision="fp32")


def test_transformer_needs_token_data_and_unknown_models_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match=r"model.name: 'transformer' needs token data \(data.name 'tokens'\)"):
        build_model("transformer", {}, DIGITS, seed=0, precision="fp32")
    with pytest.raises(SpecError, match="model.name: unknown model 'resnet'"):
        build_model("resnet", {}, DIGITS, seed=0, precision="fp32")

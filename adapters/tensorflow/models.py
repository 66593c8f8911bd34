"""Keras 3 versions of the zoo models, and the portable names and layouts of their variables.

The structure, parameter names, shapes (after the layout conversion) and initial
distributions are those of ``polytrain.adapters.torch.models``: every weight and bias
of a layer with fan-in ``n`` starts as U(−1/√n, 1/√n), which is what PyTorch's
``nn.Linear``/``nn.Conv2d`` defaults (kaiming-uniform with a=√5) amount to. Keras keeps
dense kernels as (in, out) and convolution kernels as (kh, kw, in, out); the portable
layout is PyTorch's (out, in) and (out, in, kh, kw) — see ``docs/portable-state.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from polytrain.errors import SpecError
from polytrain.protocols import DatasetInfo
from polytrain.zoo import ConvNetParams, MLPParams, is_import_path, load_factory, model_params

#: Layouts: how a Keras variable's array maps to the portable array.
AS_IS = "as-is"
DENSE_KERNEL = "dense-kernel"  # Keras (in, out)          ↔ portable (out, in)
CONV_KERNEL = "conv2d-kernel"  # Keras (kh, kw, in, out)  ↔ portable (out, in, kh, kw)

_TO_PORTABLE = {DENSE_KERNEL: (1, 0), CONV_KERNEL: (3, 2, 0, 1)}
_FROM_PORTABLE = {DENSE_KERNEL: (1, 0), CONV_KERNEL: (2, 3, 1, 0)}


def to_portable(array: np.ndarray, layout: str) -> np.ndarray:
    axes = _TO_PORTABLE.get(layout)
    return np.ascontiguousarray(array if axes is None else np.transpose(array, axes))


def from_portable(array: np.ndarray, layout: str) -> np.ndarray:
    axes = _FROM_PORTABLE.get(layout)
    return np.ascontiguousarray(array if axes is None else np.transpose(array, axes))


@dataclass(frozen=True)
class PortableVariable:
    name: str  # the portable name, e.g. "hidden.0.weight"
    variable: Any  # a keras.Variable
    layout: str


def _layer_seed(seed: int, index: int) -> int:
    """The initializer seed of a model's ``index``-th tensor: fixed by the spec's seed, alike on every rank."""
    return (1000 * seed + index) % 2**31


def _uniform(fan_in: int, seed: int) -> keras.initializers.Initializer:
    """PyTorch's default for Linear/Conv weights and biases: U(−1/√fan_in, 1/√fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return keras.initializers.RandomUniform(-bound, bound, seed=seed)


def _activation(name: str) -> Any:
    if name == "gelu":
        return lambda x: keras.activations.gelu(x, approximate=False)  # torch nn.GELU() is the exact form
    return name


def _dense(units: int, fan_in: int, seed: int, activation: Any, dtype: Any, name: str) -> keras.layers.Dense:
    """A dense layer whose kernel and bias draw from seeds ``seed`` and ``seed + 1``."""
    return keras.layers.Dense(units, activation=activation, kernel_initializer=_uniform(fan_in, seed),
                              bias_initializer=_uniform(fan_in, seed + 1), dtype=dtype, name=name)


class MLP(keras.Model):
    def __init__(self, in_features: int, num_outputs: int, params: MLPParams, seed: int, dtype: Any) -> None:
        super().__init__(name="mlp")
        sizes = (in_features, *params.hidden_sizes)
        act = _activation(params.activation)
        self.in_features = in_features
        self.hidden = [_dense(b, a, _layer_seed(seed, 2 * i), act, dtype, f"hidden_{i}")
                       for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
        self.head = _dense(num_outputs, sizes[-1], _layer_seed(seed, 2 * len(self.hidden)), None, dtype, "head")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.reshape(x, (tf.shape(x)[0], self.in_features))
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)

    def portable_variables(self) -> list[PortableVariable]:
        out = []
        for i, layer in enumerate(self.hidden):
            out += [PortableVariable(f"hidden.{i}.weight", layer.kernel, DENSE_KERNEL),
                    PortableVariable(f"hidden.{i}.bias", layer.bias, AS_IS)]
        return out + [PortableVariable("head.weight", self.head.kernel, DENSE_KERNEL),
                      PortableVariable("head.bias", self.head.bias, AS_IS)]


class ConvNet(keras.Model):
    """Same-padded convolutions, a 2×2 max-pool after the last one, then a linear head.

    Samples arrive flat in PyTorch's (C, H, W) order; the convolutions run channels-last
    (what TensorFlow's CPU kernels support) and the pooled map is put back in (C, H, W)
    order before flattening, so the head's weights mean the same as in PyTorch.
    """

    def __init__(self, image_shape: tuple[int, int, int], num_outputs: int, params: ConvNetParams, seed: int,
                 dtype: Any) -> None:
        super().__init__(name="convnet")
        channels, height, width = image_shape
        chans = (channels, *params.channels)
        k = params.kernel_size
        act = _activation(params.activation)
        self.image_shape = image_shape
        self.conv = [
            keras.layers.Conv2D(b, k, padding="same", activation=act, dtype=dtype, name=f"conv_{i}",
                                kernel_initializer=_uniform(a * k * k, _layer_seed(seed, 2 * i)),
                                bias_initializer=_uniform(a * k * k, _layer_seed(seed, 2 * i + 1)))
            for i, (a, b) in enumerate(zip(chans[:-1], chans[1:]))]
        self.pool = keras.layers.MaxPooling2D(2, dtype=dtype, name="pool")
        self.flat_features = chans[-1] * (height // 2) * (width // 2)
        self.head = _dense(num_outputs, self.flat_features, _layer_seed(seed, 2 * len(self.conv)), None, dtype,
                           "head")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        batch = tf.shape(x)[0]
        x = tf.transpose(tf.reshape(x, (batch, *self.image_shape)), (0, 2, 3, 1))
        for layer in self.conv:
            x = layer(x)
        x = tf.transpose(self.pool(x), (0, 3, 1, 2))
        return self.head(tf.reshape(x, (batch, self.flat_features)))

    def portable_variables(self) -> list[PortableVariable]:
        out = []
        for i, layer in enumerate(self.conv):
            out += [PortableVariable(f"conv.{i}.weight", layer.kernel, CONV_KERNEL),
                    PortableVariable(f"conv.{i}.bias", layer.bias, AS_IS)]
        return out + [PortableVariable("head.weight", self.head.kernel, DENSE_KERNEL),
                      PortableVariable("head.bias", self.head.bias, AS_IS)]


def _user_model(name: str, params: Any, info: DatasetInfo, dtype: str) -> keras.Model:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)  # a user's layers pick up mixed precision from the global policy
    try:
        model = load_factory(name)(info, **dict(params))
    finally:
        keras.config.set_dtype_policy(previous)
    if not isinstance(model, keras.Model):
        raise SpecError(f"model.name: {name} returned {type(model).__name__}, not a keras.Model")
    return model


def user_portable_variables(model: keras.Model) -> list[PortableVariable]:
    """A user's model: every variable under its Keras path, in Keras' own layout.

    Random-number state (the ``seed_generator_state`` of Dropout and similar layers) is not model state.
    """
    entries = [PortableVariable(v.path, v, AS_IS) for v in model.variables if v.name != "seed_generator_state"]
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"model.name: the model's variables need unique paths; repeated: {', '.join(duplicates)}")
    return entries


def build_model(name: str, params: Any, info: DatasetInfo, *, seed: int,
                precision: str) -> tuple[keras.Model, list[PortableVariable]]:
    """A built Keras model and its variables under their portable names.

    Zoo models are PyTorch's twins; ``package.module:factory`` is called as
    ``factory(info, **params)`` and must return a ``keras.Model``.
    """
    dtype = "mixed_bfloat16" if precision == "bf16" else "float32"
    if is_import_path(name):
        model = _user_model(name, params, info, dtype)
    else:
        if name not in ("mlp", "convnet"):
            raise SpecError(f"model.name: {name!r} is not available with framework 'tensorflow' "
                            f"(allowed: mlp, convnet, or package.module:factory returning a keras.Model)")
        validated = model_params(name, params)
        if name == "mlp":
            model = MLP(int(np.prod(info.input_shape)), info.num_outputs, validated, seed, dtype)
        elif info.image_shape is None:
            raise SpecError(f"model.name: 'convnet' needs image data (digits, or an .npz with x of shape N×C×H×W); "
                            f"got samples of shape {info.input_shape}")
        else:
            model = ConvNet(info.image_shape, info.num_outputs, validated, seed, dtype)
    model(np.zeros((1, *info.input_shape), dtype=np.float32))  # creates the variables
    entries = model.portable_variables() if isinstance(model, (MLP, ConvNet)) else user_portable_variables(model)
    return model, entries

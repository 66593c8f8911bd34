"""Keras 3 versions of the zoo models, and the portable names and layouts of their variables.

The structure, parameter names, shapes (after the layout conversion) and initial
distributions are those of ``polytrain.adapters.torch.models`` and
``polytrain.adapters.torch.transformer``. In the MLP and the convnet every weight and bias
of a layer with fan-in ``n`` starts as U(−1/√n, 1/√n), which is what PyTorch's
``nn.Linear``/``nn.Conv2d`` defaults (kaiming-uniform with a=√5) amount to; the transformer
follows its PyTorch twin's ``_init_weights``: N(0, 0.02) for every dense kernel and
embedding, zero biases, LayerNorm scale 1 and shift 0. Keras keeps dense kernels as
(in, out) and convolution kernels as (kh, kw, in, out); the portable layout is PyTorch's
(out, in) and (out, in, kh, kw) — see ``docs/portable-state.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from polytrain.data.source import DatasetInfo
from polytrain.errors import SpecError
from polytrain.spec.user_code import call_user, user_name
from polytrain.spec.zoo import (
    ConvNetParams,
    MLPParams,
    TransformerParams,
    is_import_path,
    load_factory,
    model_params,
)

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


# ---------------------------------------------------------------------------- the transformer LM
INIT_STD = 0.02  # the PyTorch twin's _init_weights: N(0, 0.02) for Linear and Embedding weights
LN_EPS = 1e-5  # torch.nn.LayerNorm's default (Keras' own default is 1e-3)


class _Seeds:
    """Hands out the seeds of a model's initializers in creation order (the same on every rank)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.index = seed, 0

    def normal(self) -> keras.initializers.Initializer:
        self.index += 1
        return keras.initializers.RandomNormal(0.0, INIT_STD, seed=_layer_seed(self.seed, self.index - 1))


def _dropout(x: tf.Tensor, rate: float, training: bool) -> tf.Tensor:
    """Inverted dropout like ``nn.Dropout``; draws from Keras' global seed generator (per rank, checkpointed)."""
    if training and rate > 0:
        return keras.random.dropout(x, rate)
    return x


def _linear(units: int, seeds: _Seeds, dtype: Any, name: str, use_bias: bool = True) -> keras.layers.Dense:
    return keras.layers.Dense(units, use_bias=use_bias, kernel_initializer=seeds.normal(),
                              bias_initializer="zeros", dtype=dtype, name=name)


def _layer_norm(dtype: Any, name: str) -> keras.layers.LayerNormalization:
    return keras.layers.LayerNormalization(epsilon=LN_EPS, dtype=dtype, name=name)


def _dense_entries(prefix: str, layer: keras.layers.Dense) -> list[PortableVariable]:
    return [PortableVariable(f"{prefix}.weight", layer.kernel, DENSE_KERNEL),
            PortableVariable(f"{prefix}.bias", layer.bias, AS_IS)]


def _norm_entries(prefix: str, layer: keras.layers.LayerNormalization) -> list[PortableVariable]:
    return [PortableVariable(f"{prefix}.weight", layer.gamma, AS_IS),
            PortableVariable(f"{prefix}.bias", layer.beta, AS_IS)]


class CausalSelfAttention(keras.layers.Layer):
    """One fused q/k/v projection, softmax(q·kᵀ/√head_dim) under a causal mask, dropout on the weights, proj."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, seeds: _Seeds, dtype: Any, name: str) -> None:
        super().__init__(dtype=dtype, name=name)
        self.d_model, self.n_heads, self.rate = d_model, n_heads, dropout
        self.qkv = _linear(3 * d_model, seeds, dtype, "qkv")
        self.proj = _linear(d_model, seeds, dtype, "proj")

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        batch, length = tf.shape(x)[0], tf.shape(x)[1]
        head_dim = self.d_model // self.n_heads

        def heads(t: tf.Tensor) -> tf.Tensor:  # (batch, length, d) → (batch, heads, length, head_dim)
            return tf.transpose(tf.reshape(t, (batch, length, self.n_heads, head_dim)), (0, 2, 1, 3))

        q, k, v = (heads(t) for t in tf.split(self.qkv(x), 3, axis=-1))
        scores = tf.matmul(q, k, transpose_b=True) * tf.cast(1.0 / math.sqrt(head_dim), q.dtype)
        causal = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)  # key j ≤ query i
        scores = tf.where(causal, scores, tf.constant(-np.inf, scores.dtype))
        weights = _dropout(tf.nn.softmax(scores, axis=-1), self.rate, training)
        y = tf.reshape(tf.transpose(tf.matmul(weights, v), (0, 2, 1, 3)), (batch, length, self.d_model))
        return self.proj(y)


class TransformerBlock(keras.layers.Layer):
    """Pre-LayerNorm residual block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)));

    the MLP is fc, exact (erf) GELU, out — PyTorch's ``mlp.fc``/``mlp.out``, kept here as ``fc``/``out``.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, seeds: _Seeds, dtype: Any,
                 name: str) -> None:
        super().__init__(dtype=dtype, name=name)
        self.rate = dropout
        self.ln1 = _layer_norm(dtype, "ln1")
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, seeds, dtype, "attn")
        self.ln2 = _layer_norm(dtype, "ln2")
        self.fc = _linear(d_ff, seeds, dtype, "fc")
        self.out = _linear(d_model, seeds, dtype, "out")

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        x = x + _dropout(self.attn(self.ln1(x), training=training), self.rate, training)
        mlp = self.out(keras.activations.gelu(self.fc(self.ln2(x)), approximate=False))  # torch F.gelu: erf form
        return x + _dropout(mlp, self.rate, training)

    def portable_variables(self, prefix: str) -> list[PortableVariable]:
        return (_norm_entries(f"{prefix}.ln1", self.ln1) + _dense_entries(f"{prefix}.attn.qkv", self.attn.qkv)
                + _dense_entries(f"{prefix}.attn.proj", self.attn.proj) + _norm_entries(f"{prefix}.ln2", self.ln2)
                + _dense_entries(f"{prefix}.mlp.fc", self.fc) + _dense_entries(f"{prefix}.mlp.out", self.out))


class TransformerLM(keras.Model):
    """The zoo's decoder-only LM: (batch, length) int token ids → (batch, length, vocab) next-token logits.

    Token + learned position embeddings, dropout, ``n_layers`` pre-LN blocks, a final
    LayerNorm and a bias-free head; with ``tie_weights`` the head multiplies by the token
    embedding matrix itself (one variable, exported under both ``tok_emb.weight`` and
    ``head.weight``, as PyTorch's ``state_dict`` does).
    """

    def __init__(self, vocab: int, seq_len: int, params: TransformerParams, seed: int, dtype: Any) -> None:
        super().__init__(name="transformer")
        d_ff = params.d_ff or 4 * params.d_model
        seeds = _Seeds(seed)
        self.seq_len, self.rate, self.tied = seq_len, params.dropout, params.tie_weights
        self.tok_emb = keras.layers.Embedding(vocab, params.d_model, embeddings_initializer=seeds.normal(),
                                              dtype=dtype, name="tok_emb")
        self.pos_emb = keras.layers.Embedding(seq_len, params.d_model, embeddings_initializer=seeds.normal(),
                                              dtype=dtype, name="pos_emb")
        self.blocks = [TransformerBlock(params.d_model, params.n_heads, d_ff, params.dropout, seeds, dtype,
                                        f"block_{i}") for i in range(params.n_layers)]
        self.ln_f = _layer_norm(dtype, "ln_f")
        self.head = None if self.tied else _linear(vocab, seeds, dtype, "head", use_bias=False)

    def call(self, tokens: tf.Tensor, training: bool = False) -> tf.Tensor:
        length = tokens.shape[1]
        if length is not None and length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than the model's {self.seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb(tf.range(tf.shape(tokens)[1]))
        x = _dropout(x, self.rate, training)
        for block in self.blocks:
            x = block(x, training=training)
        x = self.ln_f(x)
        if self.head is not None:
            return self.head(x)
        return tf.matmul(x, tf.cast(self.tok_emb.embeddings, x.dtype), transpose_b=True)

    def portable_variables(self) -> list[PortableVariable]:
        """In PyTorch's ``state_dict`` order; a tied ``head.weight`` is the token embedding variable again."""
        out = [PortableVariable("tok_emb.weight", self.tok_emb.embeddings, AS_IS),
               PortableVariable("pos_emb.weight", self.pos_emb.embeddings, AS_IS)]
        for i, block in enumerate(self.blocks):
            out += block.portable_variables(f"blocks.{i}")
        out += _norm_entries("ln_f", self.ln_f)
        if self.head is None:
            return out + [PortableVariable("head.weight", self.tok_emb.embeddings, AS_IS)]
        return out + [PortableVariable("head.weight", self.head.kernel, DENSE_KERNEL)]


def _user_model(name: str, params: Any, info: DatasetInfo, dtype: str) -> keras.Model:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)  # a user's layers pick up mixed precision from the global policy
    try:
        model = call_user("model.name", name, load_factory(name), info, **dict(params))
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


def input_dtype(info: DatasetInfo) -> type[np.generic]:
    """The dtype of the model's input: int64 token ids for next-token data, float32 features otherwise."""
    return np.int64 if info.task == "next_token" else np.float32


def build_model(name: str, params: Any, info: DatasetInfo, *, seed: int, precision: str,
                live: Any = None) -> tuple[keras.Model, list[PortableVariable]]:
    """A built Keras model and its variables under their portable names.

    Zoo models are PyTorch's twins; ``package.module:factory`` is called as
    ``factory(info, **params)`` and must return a ``keras.Model``.
    """
    dtype = "mixed_bfloat16" if precision == "bf16" else "float32"
    if live is not None:  # a model given to polytrain.fit (the backend broadcasts rank 0's weights)
        if callable(live) and not isinstance(live, keras.Model):  # a function that builds it, inside the strategy
            live = call_user("model", f"fit:{user_name(live)}", live)
        if not isinstance(live, keras.Model):
            raise SpecError(f"model: expected a keras.Model for framework 'tensorflow', got {type(live).__name__}")
        model = live
    elif is_import_path(name):
        model = _user_model(name, params, info, dtype)
    else:
        validated = model_params(name, params)
        if name == "mlp":
            model = MLP(int(np.prod(info.input_shape)), info.num_outputs, validated, seed, dtype)
        elif name == "transformer":
            if info.task != "next_token":
                raise SpecError(f"model.name: 'transformer' needs token data (data.name 'tokens'); got a "
                                f"{info.task} task")
            model = TransformerLM(info.num_outputs, info.input_shape[0], validated, seed, dtype)
        elif info.image_shape is None:
            raise SpecError(f"model.name: 'convnet' needs image data (digits, or an .npz with x of shape N×C×H×W); "
                            f"got samples of shape {info.input_shape}")
        else:
            model = ConvNet(info.image_shape, info.num_outputs, validated, seed, dtype)
    model(np.zeros((1, *info.input_shape), dtype=input_dtype(info)))  # creates the variables
    zoo = (MLP, ConvNet, TransformerLM)
    entries = model.portable_variables() if isinstance(model, zoo) else user_portable_variables(model)
    return model, entries

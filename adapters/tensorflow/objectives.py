"""The loss and the metrics on TensorFlow tensors, inside the compiled steps (names and reduction rules:
`polytrain.spec.objectives`; the same definitions as ``adapters/torch/objectives.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from polytrain.spec import objectives as objectives
from polytrain.spec.user_code import call_user

PerSample = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def _rows(t: tf.Tensor) -> tf.Tensor:
    return tf.reshape(t, [tf.shape(t)[0], -1])


def _mse(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(_rows(out) - _rows(tf.cast(y, out.dtype))), axis=1)


def _mae(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.abs(_rows(out) - _rows(tf.cast(y, out.dtype))), axis=1)


def _bce(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    per = tf.nn.sigmoid_cross_entropy_with_logits(labels=_rows(tf.cast(y, out.dtype)), logits=_rows(out))
    return tf.reduce_mean(per, axis=1)


def _next_token(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """(batch, length, vocab) logits: each sample's mean loss over its tokens."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out), axis=1)


LOSSES: dict[str, PerSample] = {
    "cross_entropy": lambda out, y: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out),
    "mse": _mse,
    "bce": _bce,
    "next_token": _next_token,
}


def _correct(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.cast(tf.equal(tf.argmax(out, axis=-1), y), tf.float32), [-1])


def _top5(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    top = tf.math.top_k(out, k=min(5, int(out.shape[-1]))).indices
    hit = tf.reduce_any(tf.equal(tf.cast(top, y.dtype), tf.expand_dims(y, -1)), axis=-1)
    return tf.reshape(tf.cast(hit, tf.float32), [-1])


METRICS: dict[str, PerSample] = {"accuracy": _correct, "top5_accuracy": _top5, "mse": _mse, "mae": _mae}


def _checked(fn: Any, field_name: str, name: str) -> PerSample:
    """The user's function, given a single-output head's outputs shaped like the targets
    (`polytrain.spec.objectives.single_output`) and held to one value per sample (checked when the step is traced:
    sizes TensorFlow does not know yet are shown as ``batch``)."""
    def per_sample(out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        given = tf.squeeze(out, axis=-1) if objectives.single_output(_dims(out), _dims(y)) else out
        value = call_user(field_name, name, fn, given, y)
        tensor = isinstance(value, (tf.Tensor, tf.Variable))
        if not tensor or value.shape.rank != 1 or not value.shape.is_compatible_with(y.shape[:1]):
            returned = _dims(value) if tensor and value.shape.rank is not None else type(value).__name__
            raise objectives.per_sample_error(field_name, name, returned, _dims(given), _dims(y))
        return tf.cast(value, tf.float32)
    return per_sample


def _dims(t: tf.Tensor) -> tuple[int | None, ...]:
    """A tensor's shape as a tuple, None where the size is not known yet (a traced batch); () for an unknown rank."""
    return tuple(t.shape.as_list()) if t.shape.rank is not None else ()


def loss_fn(name: str, live: Any = None) -> PerSample:
    """The loss by name; ``live``: a callable given to `polytrain.fit` (the spec names it ``fit:<name>``)."""
    return objectives.resolve_loss(name, LOSSES, _checked, live)


def metric_fns(names: tuple[str, ...], live: Mapping[str, Any] | None = None) -> dict[str, PerSample]:
    return objectives.resolve_metrics(names, METRICS, _checked, live)


def evaluation(loss_name: str, loss: PerSample, metrics: dict[str, PerSample], out: tf.Tensor,
               y: tf.Tensor) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
    """(sum, count) of the loss and of every metric over one batch; the built-in next-token loss per token."""
    out = tf.cast(out, tf.float32)
    if loss_name == "next_token":
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)
    else:
        per = loss(out, y)
    totals = {"loss": (tf.reduce_sum(per), tf.cast(tf.size(per), tf.float32))}
    for name, fn in metrics.items():
        values = fn(out, y)
        totals[name] = (tf.reduce_sum(values), tf.cast(tf.size(values), tf.float32))
    return totals

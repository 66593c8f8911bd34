"""``horovod.tensorflow.util``: the helpers Horovod's TensorFlow package is built on, which its tests and some user
scripts call as ``hvd.util._executing_eagerly()`` and the like. The same names and behaviour, on TensorFlow 2.

Keras 3 variables have no ``.ref()``; `vars_to_refs` takes the reference of the ``tf.Variable`` such a variable holds
(`polytrain.horovod.tensorflow.variables`), so `refs_to_vars` gives that ``tf.Variable`` back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from polytrain.horovod.tensorflow.variables import backing_variable


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here: False while a ``tf.function`` is being traced."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a ``tf.function`` (a graph TensorFlow traces once per input signature)."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` remembering its result per (hashable) arguments and per mode, eager or traced: what ``f`` builds
    while a graph is traced is never handed to eager code, nor the reverse."""
    cache: dict[Any, Any] = {}

    @functools.wraps(f)
    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Any) -> Any:
    """A variable's hashable reference (``.ref()``); a list of them (nested lists too) as a tuple of references."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return backing_variable(variables).ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of `vars_to_refs`: a reference's variable; a tuple of references (nested too) as a list."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


__all__ = ["_cache", "_executing_eagerly", "_make_subgraph", "refs_to_vars", "vars_to_refs"]

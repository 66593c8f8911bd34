"""One identity for a variable, whether the caller holds a Keras 3 variable or the ``tf.Variable`` inside it.

Keras 3 variables (``keras.Variable``) are not ``tf.Variable``s: they have no ``.ref()`` — the
call Horovod 0.28.1 makes to register a local variable, and the reason its callbacks and
optimizers fail on Keras 3 models (``'Variable' object has no attribute 'ref'``). On the
TensorFlow backend each one holds a ``tf.Variable`` (``._value``; ``.value`` reads it, possibly
autocast). `variable_key` maps both to that ``tf.Variable``'s identity, so a variable registered
as local in either form is recognised in the other. `VariableSet` keeps the variables it holds
alive, so an identity is never reused while it is registered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf


def backing_variable(var: Any) -> Any:
    """The ``tf.Variable`` a Keras 3 variable holds (``var`` itself for anything else)."""
    inner = getattr(var, "_value", None)
    return inner if isinstance(inner, tf.Variable) and not isinstance(var, tf.Variable) else var


def variable_key(var: Any) -> int:
    """The same key for a Keras 3 variable and for the ``tf.Variable`` it holds."""
    return id(backing_variable(var))


class VariableSet:
    """A set of variables by `variable_key` (Horovod keeps ``var.ref()``s, which Keras 3 lacks)."""

    def __init__(self, variables: Iterable[Any] = ()) -> None:
        self._held: dict[int, Any] = {}
        for var in variables:
            self.add(var)

    def add(self, var: Any) -> None:
        self._held[variable_key(var)] = var

    def __contains__(self, var: Any) -> bool:
        return variable_key(var) in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __bool__(self) -> bool:
        return bool(self._held)


def as_list(items: Any) -> list:
    """``None`` → [], one item → [item], a list or tuple → a list."""
    if items is None:
        return []
    return list(items) if isinstance(items, (list, tuple)) else [items]


__all__ = ["VariableSet", "as_list", "backing_variable", "variable_key"]

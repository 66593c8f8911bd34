"""A Keras model factory for fault-injection tests: rank ``FAULT_RANK`` dies at its ``FAULT_AT``-th training call.

``FAULT_MODE=kill`` SIGKILLs the process (a dead peer); ``FAULT_MODE=raise`` raises inside the
step (a rank that fails alone while the others wait in a collective); ``FAULT_MODE=sleep`` sleeps
``FAULT_SLEEP`` seconds (a stalled rank). The check runs as a
``tf.py_function`` so it happens on every call of the compiled step, not once at tracing.
"""

from __future__ import annotations

import os
import signal
import time

import keras
import tensorflow as tf


def _rank() -> str | None:
    return os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")


class Fault(keras.layers.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _tick(self, x: tf.Tensor) -> tf.Tensor:
        self.calls += 1
        if _rank() == os.environ.get("FAULT_RANK") and self.calls == int(os.environ.get("FAULT_AT", "-1")):
            if os.environ.get("FAULT_MODE", "kill") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ.get("FAULT_MODE") == "sleep":
                time.sleep(float(os.environ.get("FAULT_SLEEP", "10")))
                return x
            raise RuntimeError(f"injected failure on rank {_rank()}")
        return x

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        if not training:
            return x
        out = tf.py_function(self._tick, [x], Tout=x.dtype)
        out.set_shape(x.shape)
        return out


def make(info, hidden: int = 64) -> keras.Model:
    inputs = keras.Input(shape=info.input_shape)
    flat = keras.layers.Flatten()(inputs)
    hidden_out = keras.layers.Dense(hidden, activation="relu")(Fault()(flat))
    return keras.Model(inputs, keras.layers.Dense(info.num_outputs)(hidden_out))



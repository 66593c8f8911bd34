"""Gradients averaged over the ranks for a TensorFlow own loop, eagerly or inside a ``tf.function``, and the Keras
optimizer that does it for ``model.fit``.

`Averager.average` runs through the backend the Trainer uses. Eagerly, it is the backend's own hook: the gradients
are copied into float32 accumulator variables (made once per set of shapes) and ``average_gradients`` replaces them
by their mean over the ranks, in place, as after the Trainer's last micro-step. Inside a ``tf.function`` (a
compiled train step, ``model.fit``) the same averaging is traced into the graph: the backend's ``average_in_graph``
for backends whose collectives are TensorFlow ops (horovod, tf-multiworker), and for ``mpi`` one
``tf.numpy_function`` that averages the gradients packed back to back, with the same fusion buckets as the hook.
Under XLA (``jit_compile``) no backend's collective can run: that is a one-line error.

`DistributedOptimizer` holds the user's Keras optimizer (the pattern of Keras' ``LossScaleOptimizer``) and averages
the gradients of every ``apply``/``apply_gradients`` before the wrapped optimizer applies them. ``model.fit``'s
compiled train step applies through it, so each rank steps with the gradient of the whole global batch; the
strategy's own ``fit`` is not used (Keras 3's ``fit`` fails under ``MultiWorkerMirroredStrategy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from polytrain.errors import OwnLoopError


def in_xla() -> bool:
    """Whether the code being traced is compiled by XLA (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util  # TensorFlow exports no public test for this

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


class Averager:
    """Averages lists of gradients over the ranks through ``backend`` (see the module)."""

    def __init__(self, backend: Any, size: int) -> None:
        self.backend, self.size = backend, size
        self._accumulators: dict[tuple[Any, ...], list[tf.Variable]] = {}

    def average(self, grads: Sequence[Any], verb: str = "gradient") -> list[Any]:
        """``grads`` averaged over the ranks, in the same order (None stays None; IndexedSlices come back dense).
        Every rank calls it with gradients of the same shapes, in the same order."""
        grads = list(grads)
        if self.size == 1:
            return grads
        if in_xla():
            raise OwnLoopError(f"{verb}: the step is compiled with XLA (jit_compile), which cannot run the "
                               f"collectives of backend {self.backend.name!r}; compile it with jit_compile=False "
                               f"(for model.fit: model.compile(..., jit_compile=False))")
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in present]
        if not dense:
            return grads
        if not tf.executing_eagerly() and not hasattr(self.backend, "average_in_graph"):
            averaged = self._host_in_graph(dense)
        else:
            slots = self._slots(dense)
            for slot, grad in zip(slots, dense):
                slot.assign(tf.cast(grad, tf.float32))
            if tf.executing_eagerly():
                self.backend.average_gradients(slots)  # the hook the Trainer calls after its last micro-step
            else:
                self.backend.average_in_graph(slots)
            averaged = [tf.cast(slot.read_value(), grad.dtype) for slot, grad in zip(slots, dense)]
        for i, value in zip(present, averaged):
            grads[i] = value
        return grads

    def _slots(self, dense: list[tf.Tensor]) -> list[tf.Variable]:
        """The float32 accumulators for gradients of these shapes (the same list each time: the backends keep
        their fusion plan for it)."""
        key = tuple((tuple(g.shape.as_list()), g.dtype.name) for g in dense)
        if key not in self._accumulators:
            if any(None in shape for shape, _ in key):
                raise OwnLoopError("gradient: a gradient has an unknown shape; average gradients of variables "
                                   "(whose shapes are fixed)")
            with tf.init_scope():  # made eagerly, also while a tf.function is being traced
                self._accumulators[key] = [tf.Variable(tf.zeros(shape, tf.float32), trainable=False,
                                                       name=f"polytrain_grad_{i}") for i, (shape, _) in enumerate(key)]
        return self._accumulators[key]

    def _host_in_graph(self, dense: list[tf.Tensor]) -> list[tf.Tensor]:
        """The ``mpi`` backend's averaging (`MpiCollectives.average_flat_`, what its hook runs) as one op."""
        mpi = self.backend.mpi
        sizes = [int(np.prod(g.shape.as_list())) for g in dense]
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in dense], axis=0)

        def reduce(values: np.ndarray) -> np.ndarray:
            out = np.array(values, dtype=np.float32, copy=True)
            mpi.average_flat_(out, sizes)
            return out

        averaged = tf.numpy_function(reduce, [flat], tf.float32, stateful=True, name="polytrain_average")
        averaged.set_shape(flat.shape)
        return [tf.cast(tf.reshape(part, g.shape), g.dtype) for part, g in zip(tf.split(averaged, sizes), dense)]


class DistributedOptimizer(keras.optimizers.Optimizer):
    """The Keras optimizer `Distributed.setup` returns: ``optimizer`` stepping with gradients averaged over the
    ranks. Its variables, learning rate and iteration count are the wrapped optimizer's."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, averager: Averager, name: str | None = None) -> None:
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self._averager = averager

    @property
    def variables(self) -> list[Any]:
        return self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Any) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def build(self, var_list: Sequence[Any]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        """Average ``grads`` over the ranks, then let the wrapped optimizer apply them."""
        if trainable_variables is None:
            trainable_variables = self.inner_optimizer._trainable_variables  # what Keras' own apply falls back to
        variables = list(trainable_variables)
        if not self.built:
            self.build(variables)
        return self.inner_optimizer.apply(self._averager.average(grads, "apply_gradients"), variables)

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise OwnLoopError("model.fit: polytrain.tensorflow runs on Keras' TensorFlow backend, which has no "
                           "stateless_apply")

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """A saved model comes back with the wrapped optimizer alone (averaging needs a running job:
        `Distributed.setup` wraps it again)."""
        return keras.saving.deserialize_keras_object(config["optimizer"], custom_objects=custom_objects)

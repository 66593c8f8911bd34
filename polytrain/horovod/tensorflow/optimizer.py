"""``DistributedOptimizer`` for Keras 3: any Keras optimizer, gradients averaged across processes.

A plain subclass of ``keras.optimizers.Optimizer`` that holds the user's optimizer (the
pattern of Keras's own ``LossScaleOptimizer``) — no class synthesis. Keras 3 funnels every
update through ``apply(grads, trainable_variables)``: ``model.fit``'s compiled train step calls
``apply_gradients`` → ``apply``, and so do custom loops. ``apply`` reduces the gradients with
`GradientReducer` and hands them to the wrapped optimizer, whose variables, learning rate and
iteration count are the ones the outside world sees (callbacks, checkpoints).

Non-finite gradients with ``backward_passes_per_step > 1`` (Horovod's rule, which its
``test_grad_aggregation_with_inf_grad`` pins): an inf/nan in any pass, on any rank, goes into
that cycle's sum, through the allreduce to every rank, and into the update the wrapped
optimizer makes — plain SGD writes the inf into the weights, a ``LossScaleOptimizer`` wrapped
*inside* ``DistributedOptimizer`` sees it on every rank and skips the step everywhere (halving
its scale). Nothing is dropped and no rank decides alone, so the ranks' collectives stay in
step. The sums are then reset by assignment (never ``acc - acc``, which would leave nan), so
the next cycle starts from zero. Wrap a loss-scale optimizer inside, not around: outside, each
rank would skip or apply on its own gradients' finiteness and the ranks' allreduces would no
longer pair up.

Horovod's Keras 2 optimizers also computed gradients (``_compute_gradients(loss, var_list,
grad_loss=None, tape=None)``, ``compute_gradients``), which its tests and some scripts call
before ``apply_gradients``. Here they return the gradients reduced as `apply` reduces them, and
`apply` takes exactly those back without reducing them again: every gradient is reduced once,
whichever way it came.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from polytrain.horovod.common import Average, HorovodArgumentError, Sum
from polytrain.horovod.tensorflow import _impl
from polytrain.horovod.tensorflow.compression import Compression
from polytrain.horovod.tensorflow.gradient_tape import GradientReducer, resolve_groups
from polytrain.horovod.tensorflow.variables import as_list, backing_variable, variable_key


class _HandedOut:
    """The reduced gradients `DistributedOptimizer._compute_gradients` returned last, which `apply` takes as they
    are (known by identity, so also while a ``tf.function`` is traced); held until then, so no identity is reused."""

    def __init__(self) -> None:
        self.grads: list = []

    def take(self, grads: list) -> bool:
        """Whether ``grads`` are the ones handed out (each non-None one, by identity); forgets them either way."""
        handed, self.grads = self.grads, []
        present = [g for g in grads if g is not None]
        return bool(present) and len(present) == len(handed) and all(any(g is h for h in handed) for g in present)


@keras.saving.register_keras_serializable(package="polytrain.horovod")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap ``optimizer`` so each update uses gradients reduced (by default averaged) over all ranks.

    ``backward_passes_per_step=N`` accumulates N local gradients and reduces once, applying an
    update every N-th call (the iteration count still advances every call, as in Horovod);
    ``average_aggregated_gradients`` divides the sum by N.
    """

    def __init__(self, optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None,
                 process_set=_impl.global_process_set, scale_local_gradients=True, **kwargs):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise HorovodArgumentError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer; got "
                                       f"{type(optimizer).__name__}")
        if op not in (Average, Sum):
            raise HorovodArgumentError("op currently only supports Average and Sum")
        if int(backward_passes_per_step) < 1:
            raise HorovodArgumentError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}", **kwargs)
        self.inner_optimizer = optimizer
        self.compression = compression
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self._reducer = GradientReducer(
            device_dense=device_dense, device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, op=op, gradient_predivide_factor=gradient_predivide_factor,
            groups=resolve_groups(num_groups, groups), process_set=process_set,
            scale_local_gradients=scale_local_gradients)
        self._accumulators: list = []
        self._handed_out = _HandedOut()

    # ------------------------------------------------------------------ what the outside world sees
    @property
    def variables(self):
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def aggregation_variables(self) -> list:
        """The pass count and the per-variable sums of ``backward_passes_per_step > 1`` ([] otherwise);
        kept by ``hvd.elastic`` states next to `variables`."""
        count = getattr(self, "_pass_count", None)  # made by build() when backward_passes_per_step > 1
        return [] if count is None else [count, *self._accumulators]

    def __getattr__(self, name: str):
        # momentum, beta_1, epsilon, ... of the wrapped optimizer (only reached for unknown names)
        if name.startswith("_") or name == "inner_optimizer":
            raise AttributeError(name)
        return getattr(self.inner_optimizer, name)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local (divided by the size if ``scale_local_gradients``)."""
        self._reducer.register_local(var)

    # ------------------------------------------------------------------ building and applying
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        if self.backward_passes_per_step > 1:
            self._pass_count = self.add_variable((), initializer="zeros", dtype="int32", name="backward_passes")
            self._accumulators = [self.add_variable_from_reference(v, name="horovod_accumulator")
                                  for v in var_list]

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = self.inner_optimizer._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        if self.backward_passes_per_step > 1:
            return self._accumulate_and_apply(grads, trainable_variables)
        if not self._handed_out.take(grads):  # those of _compute_gradients are reduced already
            grads = self._reducer(grads, trainable_variables)
        return self.inner_optimizer.apply(grads, trainable_variables)

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """Apply ``(gradient, variable)`` pairs (reduced across processes once: see `apply`). ``name`` and
        ``experimental_aggregate_gradients`` are Keras 2's, accepted for the scripts and tests written for Horovod
        on it; they change nothing here."""
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's (and Keras 2 optimizers') gradient computation: ``(gradient, variable)`` pairs of ``loss`` for
        ``var_list`` (a list, nested lists, or a callable returning them), in `apply_gradients`' form.

        ``loss`` is a callable, recorded on ``tape`` or on a new ``tf.GradientTape``, or a tensor ``tape`` recorded;
        ``grad_loss`` the gradient of the loss, if not ones. The loss is scaled as the wrapped optimizer asks
        (``scale_loss``: a ``LossScaleOptimizer``'s scale). The gradients are reduced across processes as `apply`
        reduces them (local variables: divided by the size), and `apply` takes them back without reducing them
        again. With ``backward_passes_per_step > 1`` they are this pass's own: `apply` sums the passes and reduces
        the sum at the last one (Horovod returned the reduced sum at the last pass; the updates are the same).
        """
        if not callable(loss) and tape is None:
            raise HorovodArgumentError("`tape` is required when a `Tensor` loss is passed.")
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch([backing_variable(v) for v in tf.nest.flatten(var_list)])
                loss = loss()
                if callable(var_list):
                    var_list = var_list()
        with tape:
            loss = self.scale_loss(loss)
        variables = tf.nest.flatten(var_list)
        grads = tape.gradient(loss, variables, output_gradients=grad_loss)
        if self.backward_passes_per_step == 1:
            grads = self._reducer(grads, variables)
            self._handed_out.grads = [g for g in grads if g is not None]
        return list(zip(grads, variables))

    def compute_gradients(self, loss, var_list, tape=None):
        """`_compute_gradients` without ``grad_loss`` (Horovod's public name)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _accumulate_and_apply(self, grads, variables):
        index = {variable_key(v): i for i, v in enumerate(self._trainable_variables)}
        slots = [self._accumulators[index[variable_key(v)]] for v in variables]
        for acc, g in zip(slots, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._pass_count.assign_add(1)
        n = self.backward_passes_per_step

        def reduce_and_apply():
            summed = [None if g is None else tf.convert_to_tensor(acc) for acc, g in zip(slots, grads)]
            reduced = self._reducer(summed, variables)
            if self.average_aggregated_gradients:
                reduced = [None if g is None else g / tf.cast(n, g.dtype) for g in reduced]
            self.inner_optimizer.apply(reduced, variables)
            for acc in slots:
                acc.assign(tf.zeros_like(acc))
            self._pass_count.assign(0)
            return tf.constant(True)

        def count_only():
            self.inner_optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(tf.convert_to_tensor(self._pass_count), n), reduce_and_apply, count_only)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("DistributedOptimizer runs on the TensorFlow backend, which has no stateless_apply")

    # ------------------------------------------------------------------ serialization
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": self.op,
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "compression": "fp16" if self.compression is Compression.fp16 else "none",
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        config["compression"] = getattr(Compression, config.get("compression", "none"))
        return cls(inner, **config)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, groups=None, process_set=_impl.global_process_set, local_layers=None,
                                scale_local_gradients=True, backward_passes_per_step=1,
                                average_aggregated_gradients=False) -> DistributedOptimizer:
    """A `DistributedOptimizer` that keeps the gradients of ``local_layers``' trainable weights local.

    Those gradients are not allreduced — only divided by the number of processes when
    ``scale_local_gradients`` (Horovod's rule) — so each process trains its own copy of those
    layers; every other gradient is reduced as usual. ``backward_passes_per_step`` and
    ``average_aggregated_gradients`` are polytrain's additions (Horovod's signature lacks them).
    """
    layers = as_list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise HorovodArgumentError("All local layers must be of tf.keras.layers.Layer type.")
    wrapped = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped

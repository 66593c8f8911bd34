"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` averages across processes.

Built by composition — it holds the user's tape and forwards everything else to it — instead
of Horovod's ``type(...)`` class synthesis, which reaches into tape internals and breaks with
Keras 3 variables. `GradientReducer` is shared with the Keras ``DistributedOptimizer``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import tensorflow as tf

from polytrain.horovod.common import Average, HorovodArgumentError
from polytrain.horovod.tensorflow import _impl
from polytrain.horovod.tensorflow.collectives import _check_op, grouped_allreduce
from polytrain.horovod.tensorflow.compression import Compression
from polytrain.horovod.tensorflow.variables import VariableSet, as_list

global_process_set = _impl.global_process_set


def _split_list(items: list, n: int) -> list[list]:
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def resolve_groups(num_groups: int, groups):
    """Horovod's checks: ``num_groups`` is deprecated for ``groups``, a positive int or lists of variables."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise HorovodArgumentError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return groups


class GradientReducer:
    """Reduces a list of gradients of a list of variables the way Horovod's optimizers do."""

    def __init__(self, *, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True) -> None:
        _check_op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise HorovodArgumentError("gradient_predivide_factor not supported with op != Average")
        self.kwargs = dict(device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                           op=op, process_set=process_set)
        # Average divides by the size itself: split it around the sum as Horovod does
        self.prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale = gradient_predivide_factor if op == Average else 1.0
        self.sparse_as_dense = sparse_as_dense
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_vars = VariableSet()  # a Keras 3 variable or the tf.Variable it holds, either form

    def register_local(self, variable) -> None:
        self.local_vars.add(variable)

    def _group_indices(self, present: list[int], variables: Sequence) -> list[list[int]]:
        if self.groups is None:
            return [present] if present else []
        if isinstance(self.groups, int):
            return [g for g in _split_list(present, self.groups) if g]
        by_id = {id(variables[i]): i for i in present}
        out = []
        for group in self.groups:
            idx = [by_id.pop(id(v)) for v in group if id(v) in by_id]
            if idx:
                out.append(idx)
        return out + [[i] for i in present if id(variables[i]) in by_id]

    def __call__(self, grads: Sequence, variables: Sequence) -> list:
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        n = self.process_set.size()
        if not n or n == 1:  # Horovod skips the collective on one process
            return grads
        present = [i for i, g in enumerate(grads) if g is not None and variables[i] not in self.local_vars]
        out = list(grads)
        for idx in self._group_indices(present, variables):
            reduced = grouped_allreduce([grads[i] for i in idx], prescale_factor=self.prescale,
                                        postscale_factor=self.postscale, **self.kwargs)
            for i, r in zip(idx, reduced):
                out[i] = r
        if self.scale_local_gradients and self.local_vars:
            for i, (g, v) in enumerate(zip(grads, variables)):
                if g is not None and v in self.local_vars:
                    out[i] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / tf.cast(n, g.dtype))
        return out


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``; ``gradient()`` returns gradients reduced across processes."""

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True) -> None:
        self._wrapped = gradtape
        self._reducer = GradientReducer(
            device_dense=device_dense, device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, op=op, gradient_predivide_factor=gradient_predivide_factor,
            groups=resolve_groups(num_groups, groups), process_set=process_set,
            scale_local_gradients=scale_local_gradients)
        self.process_set = process_set

    @property
    def tape(self) -> tf.GradientTape:
        """The wrapped ``tf.GradientTape``."""
        return self._wrapped

    def __enter__(self) -> DistributedGradientTape:
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._wrapped.__exit__(*exc_info)

    def __getattr__(self, name: str):  # watch, stop_recording, jacobian, reset, ...
        return getattr(self._wrapped, name)

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local (divided by the size if ``scale_local_gradients``)."""
        self._reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """The wrapped tape's gradients, reduced across processes, in the structure of ``sources``."""
        grads = self._wrapped.gradient(target, sources, output_gradients=output_gradients,
                                       unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        flat_grads = tf.nest.flatten(grads, expand_composites=False) if tf.nest.is_nested(grads) else [grads]
        reduced = self._reducer(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced) if tf.nest.is_nested(grads) else reduced[0]

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``(local, global)`` lists of ``(source, gradient)`` pairs."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local, shared = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if s in self._reducer.local_vars else shared).append((s, g))
        return local, shared


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True) -> DistributedGradientTape:
    """A `DistributedGradientTape` that keeps the gradients of ``local_layers`` local."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in as_list(local_layers):
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape

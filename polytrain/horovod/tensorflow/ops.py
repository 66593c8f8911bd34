"""polytrain's own Horovod raw TensorFlow collectives, on MPI (mpi4py) or one process.

Each collective is a ``tf.numpy_function`` around `engine.Engine`, so it runs eagerly and
inside ``tf.function`` (including Keras ``model.fit``) with static output shapes set, and has
Horovod's gradient registered through ``tf.custom_gradient``. MPI needs every rank to issue
collectives in the same order: inside a graph each op gets a control dependency on the
previous one (TensorFlow's automatic control dependencies order these stateful ops too).
The basics (init, rank, size, ...) are in `basics`.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from polytrain.errors import BackendUnavailableError
from polytrain.horovod.common import Average, HorovodUnsupportedError, Sum, split_rows
from polytrain.horovod.tensorflow.process_sets import ProcessSet, global_process_set
from polytrain.horovod.tensorflow.runtime import engine, rank, size

_last_op: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_list(result) -> list[tf.Tensor]:
    return list(result) if isinstance(result, (list, tuple)) else [result]  # one output comes back bare


def _run(fn, inputs: list, tout: list, name: str | None) -> list[tf.Tensor]:
    """``fn`` on numpy values as one TF op, ordered after this graph's previous collective."""
    engine()  # not initialized -> Horovod's error now, not at graph run time
    if tf.executing_eagerly():
        return _as_list(tf.numpy_function(fn, inputs, tout, stateful=True, name=name))
    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise BackendUnavailableError("polytrain's MPI collectives cannot run inside XLA; compile with "
                                      "jit_compile=False (model.compile(..., jit_compile=False))")
    previous = _last_op.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        outs = _as_list(tf.numpy_function(fn, inputs, tout, stateful=True, name=name))
    _last_op[graph] = outs[0].op
    return outs


def _check_set(process_set: ProcessSet) -> None:
    if process_set is not global_process_set and process_set.ranks != global_process_set.ranks:
        raise HorovodUnsupportedError("polytrain's Horovod shim supports only the global process set; "
                                      "use real Horovod for process sets")


def _name(name, default: str) -> str | None:
    return None if name is None else f"{default}_{name}".replace("/", "_").replace(":", "_")


def grouped_allreduce(tensors, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set=global_process_set, ignore_name_scope=False) -> list[tf.Tensor]:
    """Reduce ``tensors`` in one fused MPI call per dtype; differentiable (gradient: the same reduction)."""
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    @tf.custom_gradient
    def reduce(*xs):
        def fn(*arrays):
            return engine().allreduce(arrays, op, prescale_factor, postscale_factor)

        ys = _run(fn, list(xs), [x.dtype for x in xs], _name(name, "HorovodAllreduce"))
        for x, y in zip(xs, ys):
            y.set_shape(x.shape)

        def grad(*dys):
            return grouped_allreduce([tf.zeros_like(x) if dy is None else dy for x, dy in zip(xs, dys)],
                                     op, prescale_factor, postscale_factor, process_set=process_set)

        return ys, grad

    return list(reduce(*tensors))


def allreduce(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False) -> tf.Tensor:
    return grouped_allreduce([tensor], op, prescale_factor, postscale_factor, name, process_set)[0]


def allgather(tensor, name=None, process_set=global_process_set, ignore_name_scope=False) -> tf.Tensor:
    """Concatenate along the first dimension; gradient: averaged, then this rank's rows (as Horovod)."""
    _check_set(process_set)

    @tf.custom_gradient
    def gather(x):
        def fn(a):
            return engine().allgather(a)

        y, rows = _run(fn, [x], [x.dtype, tf.int32], _name(name, "HorovodAllgather"))
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        rows.set_shape([size()])

        def grad(dy):
            dy = allreduce(dy, Average, process_set=process_set)
            start = tf.reduce_sum(rows[:rank()])
            return dy[start:start + rows[rank()]]

        return y, grad

    return gather(tf.convert_to_tensor(tensor))


def grouped_allgather(tensors, name=None, process_set=global_process_set, ignore_name_scope=False):
    return [allgather(t, process_set=process_set) for t in tensors]


def grouped_broadcast(tensors, root_rank: int, process_set=global_process_set) -> list[tf.Tensor]:
    """Root's values of ``tensors`` in one MPI broadcast; gradient: averaged, zero off the root."""
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    @tf.custom_gradient
    def bcast(*xs):
        def fn(*arrays):
            return engine().broadcast(arrays, root_rank)

        ys = _run(fn, list(xs), [x.dtype for x in xs], "HorovodBroadcast")
        for x, y in zip(xs, ys):
            y.set_shape(x.shape)

        def grad(*dys):
            dys = grouped_allreduce([tf.zeros_like(x) if d is None else d for x, d in zip(xs, dys)],
                                    Average, process_set=process_set)
            return dys if rank() == root_rank else [d * 0 for d in dys]

        return ys, grad

    return list(bcast(*tensors))


def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set,
              ignore_name_scope=False) -> tf.Tensor:
    return grouped_broadcast([tensor], root_rank, process_set)[0]


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, ignore_name_scope=False):
    """Scatter first-dimension slices to every rank; (received tensor, received splits)."""
    _check_set(process_set)
    splits = tf.constant([], tf.int32) if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)

    @tf.custom_gradient
    def exchange(x):
        def fn(a, s):
            return engine().alltoall(a, s if s.size else None)

        y, received = _run(fn, [x, splits], [x.dtype, tf.int32], _name(name, "HorovodAlltoall"))
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([size()])

        def grad(dy, _unused=None):
            return alltoall(dy, splits=received, process_set=process_set)[0]

        return (y, received), grad

    return exchange(tf.convert_to_tensor(tensor))


def reducescatter(tensor, op=Sum, name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0) -> tf.Tensor:
    """Reduce, then give rank r its block of rows (Horovod's split); gradient as Horovod's."""
    _check_set(process_set)

    @tf.custom_gradient
    def scatter(x):
        def fn(a):
            return engine().reducescatter(a, op, prescale_factor, postscale_factor)

        (y,) = _run(fn, [x], [x.dtype], _name(name, "HorovodReducescatter"))
        rows = x.shape[0] if x.shape.rank else None
        mine = None if rows is None else split_rows(rows, size())[rank()]
        if x.shape.rank is not None:
            y.set_shape(tf.TensorShape([mine]).concatenate(x.shape[1:]))

        def grad(dy):
            scale = (size() if op == Sum else 1) * prescale_factor * postscale_factor
            return allgather(dy * tf.cast(scale, dy.dtype) if scale != 1 else dy, process_set=process_set)

        return y, grad

    return scatter(tf.convert_to_tensor(tensor))


def grouped_reducescatter(tensors, op=Sum, name=None, process_set=global_process_set,
                          ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, op, process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]


def join() -> tf.Tensor:
    """Wait until every rank joined, zero-filling the others' allreduces; the last rank to join."""
    (last,) = _run(lambda: np.array(engine().join(), np.int32), [], [tf.int32], "HorovodJoin")
    last.set_shape([])
    return last


def barrier(process_set=global_process_set) -> None:
    _check_set(process_set)
    engine().barrier()


__all__ = [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "grouped_broadcast", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier",
]

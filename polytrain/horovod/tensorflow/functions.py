"""Broadcasting variables and Python objects, gathering objects (Horovod's ``functions.py``).

Works with ``tf.Variable`` and Keras 3 variables alike: values are read as tensors and
written back with ``assign``. ``broadcast_object``/``allgather_object`` unpickle what the other
ranks of this job sent (Horovod's contract: any picklable object); the bytes never come from a
file. tests/test_no_unpickle.py lists them.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import tensorflow as tf

from polytrain.horovod.tensorflow import _impl

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle

global_process_set = _impl.global_process_set


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s values to ``variables`` on every process.

    Eagerly this returns None; inside ``tf.function`` it returns the grouped assign op.
    """
    variables = list(variables)
    values = _impl.grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank,
                                    process_set=process_set)
    assigns = [var.assign(value) for var, value in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def _dumps(obj) -> np.ndarray:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (any picklable object) on every process; run eagerly."""
    if _impl.rank() == root_rank:
        data = _dumps(obj)
        _impl.broadcast(tf.constant([data.size], tf.int32), root_rank, process_set=process_set)
    else:
        length = int(_impl.broadcast(tf.constant([0], tf.int32), root_rank, process_set=process_set).numpy()[0])
        data = np.zeros(length, dtype=np.uint8)
    data = _impl.broadcast(tf.constant(data), root_rank, process_set=process_set).numpy()
    if _impl.rank() == root_rank:
        return obj
    return _pickler.loads(data.tobytes())


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every process's ``obj``, as a list in rank order; run eagerly."""
    data = _dumps(obj)
    sizes = _impl.allgather(tf.constant([data.size], tf.int32), process_set=process_set).numpy()
    gathered = _impl.allgather(tf.constant(data), process_set=process_set).numpy()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [_pickler.loads(gathered[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(sizes))]

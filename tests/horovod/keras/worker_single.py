"""One process, no launcher: the API surface, layout, errors and serialization. Prints ``RESULT <json>``."""

from __future__ import annotations

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.keras as hvd
import polytrain.horovod.tensorflow as hvd_tf
import polytrain.horovod.tensorflow.keras as hvd_tfk
from polytrain.errors import UserError
from polytrain.horovod.tensorflow.keras.callbacks import MetricAverageCallback


def error(fn) -> list[str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the result
        return [type(exc).__name__, str(exc), str(isinstance(exc, UserError))]
    return []


def fit(optimizer) -> list[float]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.RandomState(1).randn(32, 4).astype("float32")
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=8, epochs=2, shuffle=False, verbose=0)
    return np.concatenate([np.asarray(v).ravel() for v in model.weights]).tolist()


def reload_plain(directory: str) -> list:
    """A model saved with a plain optimizer comes back from hvd.load_model wrapped, state kept."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.ones((8, 4), np.float32)
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    model.save(f"{directory}/plain.keras")
    loaded = hvd.load_model(f"{directory}/plain.keras")
    same = all(np.array_equal(a, b) for a, b in zip(loaded.optimizer.variables, model.optimizer.variables))
    loaded.fit(x, x[:, :1], epochs=1, verbose=0)
    return [type(loaded.optimizer).__name__, type(loaded.optimizer.inner_optimizer).__name__, bool(same),
            int(loaded.optimizer.iterations.numpy())]


def main() -> None:
    res: dict = {"rank": 0, "before_init": error(hvd.size)}
    hvd.init()
    res["layout"] = [hvd_tfk.DistributedOptimizer is hvd.DistributedOptimizer,
                     MetricAverageCallback is hvd.callbacks.MetricAverageCallback,
                     hvd_tfk.callbacks.LearningRateWarmupCallback is hvd.callbacks.LearningRateWarmupCallback,
                     type(hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1))).__name__]
    res["one_process_fit"] = [fit(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))),
                              fit(keras.optimizers.Adam(0.01))]
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.02), backward_passes_per_step=2)
    again = hvd.DistributedOptimizer.from_config(opt.get_config())
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    res["config"] = [type(again.inner_optimizer).__name__, float(again.learning_rate.numpy()),
                     again.backward_passes_per_step, type(revived).__name__]
    res["min_op_error"] = error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd_tf.Min))
    res["tf1_error"] = error(lambda: hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)))
    res["xla_error"] = error(lambda: tf.function(lambda t: hvd_tf.allreduce(t), jit_compile=True)(tf.ones([2])))
    res["process_set_error"] = error(lambda: hvd_tf.add_process_set([0]))
    res["reload_plain"] = reload_plain(sys.argv[1])
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

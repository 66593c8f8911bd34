"""Keras 3 local variables, PartialDistributedOptimizer and gradient aggregation with non-finite gradients.

Each rank prints ``RESULT <json>`` (see test_local_vars.py for what is asserted):

* ``callback``: BroadcastGlobalVariablesCallback from the last rank, with a non-trainable first layer
  registered as local (as Keras 3 variables), called directly so batch-norm statistics can be checked;
* ``fit``: the same through ``model.fit``, the local variables registered as the ``tf.Variable``s inside;
* ``broadcast_variables``: ``hvd.broadcast_variables`` on ``model.variables`` (seed-generator state
  included) mixed with a plain ``tf.Variable``, eagerly and in a ``tf.function``;
* ``partial``: one update of PartialDistributedOptimizer with every gradient equal to ``rank + 1``;
* ``computed``: the same gradients from its ``_compute_gradients`` (a callable loss), then ``apply_gradients``;
* ``aggregation``: backward_passes_per_step=2 with an inf gradient on the last rank only, with a
  plain SGD and with a LossScaleOptimizer wrapped inside.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.keras as hvd
import polytrain.horovod.tensorflow as hvd_tf


def model_of(value: float) -> keras.Model:
    init = keras.initializers.Constant(value)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False, name="local"),
        keras.layers.BatchNormalization(moving_mean_initializer=init, name="bn"),
        keras.layers.Dropout(0.5, seed=int(value) + 1, name="drop"),
        keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, name="out"),
    ])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0, momentum=0.5)), loss="mse")
    return model


def values(variables) -> dict[str, list[float]]:
    return {v.path: np.asarray(v, dtype=np.float64).ravel().tolist() for v in variables}


def callback_case(r: int, n: int) -> dict:
    model = model_of(float(r))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=n - 1,
                                                              local_variables=model.get_layer("local").weights)
    callback.set_model(model)
    callback.on_train_begin()
    return {"weights": values(model.weights), "optimizer": values(model.optimizer.variables),
            "done": callback.broadcast_done}


def fit_case(r: int, n: int) -> dict:
    model = model_of(float(r))
    inner = [v.value for v in model.get_layer("local").weights]  # the tf.Variables, not the Keras variables
    assert all(isinstance(v, tf.Variable) for v in inner)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=n - 1)
    for var in inner:
        callback.register_local_var(var)
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 3), "float32"), batch_size=2, epochs=1, verbose=0,
              callbacks=[callback])
    return {"weights": values(model.get_layer("local").weights + model.get_layer("out").weights)}


def broadcast_variables_case(r: int, n: int) -> dict:
    model = model_of(float(r))
    plain = tf.Variable(tf.fill([2], float(r)))
    before = values(model.variables)
    hvd_tf.broadcast_variables([*model.variables, plain], root_rank=n - 1)
    eager = {**values(model.variables), "plain": plain.numpy().tolist()}
    again = tf.Variable(tf.fill([2], float(r) * 10))

    @tf.function
    def in_graph():
        hvd_tf.broadcast_variables([model.get_layer("out").kernel, again], root_rank=0)

    in_graph()
    return {"before": before, "eager": eager, "graph": [again.numpy().tolist(),
                                                        np.asarray(model.get_layer("out").kernel).ravel().tolist()]}


def partial_case(r: int, n: int) -> dict:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="mine"), keras.layers.Dense(2, name="shared")])
    for var in model.weights:
        var.assign(tf.zeros(var.shape))
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=model.get_layer("mine"))
    grads = [tf.fill(v.shape, float(r + 1)) for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[model.get_layer("mine"), "x"])
        error = None
    except ValueError as exc:
        error = [type(exc).__name__, str(exc)]
    return {"mine": values(model.get_layer("mine").weights), "shared": values(model.get_layer("shared").weights),
            "error": error}


def computed_case(r: int, n: int) -> dict:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="mine"), keras.layers.Dense(2, name="shared")])
    for var in model.weights:
        var.assign(tf.zeros(var.shape))
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=model.get_layer("mine"))
    weights = model.trainable_variables
    grads_and_vars = opt._compute_gradients(lambda: float(r + 1) * tf.add_n([tf.reduce_sum(v) for v in weights]),
                                            weights)
    opt.apply_gradients(grads_and_vars)
    return {"grads": {v.path: np.asarray(g).ravel().tolist() for g, v in grads_and_vars},
            "mine": values(model.get_layer("mine").weights), "shared": values(model.get_layer("shared").weights)}


def aggregation_case(r: int, n: int, loss_scale: bool) -> dict:
    inner = keras.optimizers.SGD(1.0)
    if loss_scale:
        inner = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    opt = hvd.DistributedOptimizer(inner, backward_passes_per_step=2)
    x, y, z = keras.Variable([0.0]), keras.Variable([0.0]), keras.Variable([0.0])
    trace = []
    for step in range(4):
        g_x = float("inf") if (step == 0 and r == n - 1) else 1.0  # inf on the last rank, first pass only
        g_z = float("nan") if (step == 1 and r == 0 and not loss_scale) else 1.0
        opt.apply([tf.constant([g_x]), tf.constant([1.0]), tf.constant([g_z])], [x, y, z])
        trace.append({"x": float(x.numpy()[0]), "y": float(y.numpy()[0]), "z": float(z.numpy()[0]),
                      "sums": [np.asarray(v, dtype=np.float64).ravel().tolist() for v in opt.aggregation_variables],
                      "scale": float(inner.dynamic_scale.numpy()) if loss_scale else None})
    return {"trace": trace, "iterations": int(opt.iterations.numpy())}


def main() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res = {"rank": r, "size": n, "impl": hvd.IMPL}
    res["callback"] = callback_case(r, n)
    res["fit"] = fit_case(r, n)
    res["broadcast_variables"] = broadcast_variables_case(r, n)
    res["partial"] = partial_case(r, n)
    res["computed"] = computed_case(r, n)
    res["aggregation"] = aggregation_case(r, n, loss_scale=False)
    res["aggregation_loss_scale"] = aggregation_case(r, n, loss_scale=True)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

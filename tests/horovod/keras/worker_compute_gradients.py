"""One process: ``hvd.util`` and the Keras optimizers' ``_compute_gradients``, called as Horovod's own tests call them
(test/parallel/test_tensorflow2_keras.py: test_gradient_aggregation, test_grad_aggregation_with_inf_grad,
test_partial_distributed_optimizer), on Keras 3. Prints ``RESULT <json>`` (see test_single_process.py)."""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.keras as hvd_keras
import polytrain.horovod.tensorflow as hvd_tf
import polytrain.horovod.tensorflow.keras as hvd
from polytrain.horovod.tensorflow import util


def util_case() -> dict:
    calls = []

    @util._cache
    def built(n):
        calls.append(util._executing_eagerly())
        return tf.constant(n)

    @tf.function
    def traced():
        built(2)
        return util._executing_eagerly()

    built(2)
    built(2)  # cached
    graph_eager = bool(traced())
    subgraph = util._make_subgraph(lambda a: a * 2)
    keras_var, plain = keras.Variable([1.0]), tf.Variable([2.0])
    refs = util.vars_to_refs([plain, [keras_var, plain]])
    back = util.refs_to_vars(refs)
    return {"module": hvd_tf.util is util, "eager": util._executing_eagerly(), "graph": graph_eager,
            "calls": calls, "subgraph": float(subgraph(tf.constant(3.0))),
            "traced_kind": hasattr(subgraph, "get_concrete_function"),
            "refs": [isinstance(refs, tuple), isinstance(refs[1], tuple), refs[0] == refs[1][1]],
            "back": [back[0] is plain, back[1][0] is keras_var.value, isinstance(back[1], list)]}


class AddGradient(keras.optimizers.Optimizer):
    """Horovod's TestingOptimizer on Keras 3: each update adds the gradient to the variable."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


def aggregation_case(average_aggregated_gradients: bool) -> dict:
    """test_gradient_aggregation: loss = x - y[0]; 4 passes per update, in a tf.function as model.fit would."""
    passes = 4
    opt = hvd.DistributedOptimizer(AddGradient(learning_rate=1.0), backward_passes_per_step=passes,
                                   average_aggregated_gradients=average_aggregated_gradients, sparse_as_dense=True)
    x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])
    variables = [x, y]

    def loss():
        return x - tf.gather(y, [0])  # tf.gather: an IndexedSlices gradient for y

    @tf.function
    def compute_and_apply(var_list, **kwargs):
        grads_and_vars = opt._compute_gradients(loss, var_list=var_list)
        opt.apply_gradients(grads_and_vars, **kwargs)

    trace = []
    for _ in range(10):
        compute_and_apply(var_list=variables, experimental_aggregate_gradients=False)
        trace.append([float(x.numpy()[0]), *map(float, y.numpy()), int(opt.iterations.numpy())])
    return {"trace": trace, "counter": int(opt.aggregation_variables[0].numpy())}


def inf_grad_case() -> dict:
    """test_grad_aggregation_with_inf_grad: an inf gradient in the first cycle does not reach the second."""
    step_count = tf.Variable(0, trainable=False, dtype=tf.int32)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=2, sparse_as_dense=True)
    x = tf.Variable(0.0)

    def loss():
        step_count.assign_add(1)
        return tf.cond(pred=tf.greater(step_count, 1), true_fn=lambda: x, false_fn=lambda: x * float("inf"))

    grads = []
    for _ in range(4):
        grads_and_vars = opt._compute_gradients(loss=loss, var_list=[x])
        opt.apply_gradients(grads_and_vars)
        grads.append(float(grads_and_vars[0][0]))
    return {"grads": grads, "finite": bool(tf.math.is_finite(grads_and_vars[0][0])),
            "sums": [float(v.numpy()) for v in opt.aggregation_variables[1:]], "x": float(x.numpy())}


def partial_case() -> dict:
    """test_partial_distributed_optimizer, with a tape: local layers' gradients are the tape's / size, the others
    the average (on one process, the tape's own)."""
    out = {}
    for num_local_layers in range(3):
        init = keras.initializers.Constant(hvd.rank() + 0.5)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=init,
                                                                         bias_initializer=init),
                                  keras.layers.RepeatVector(3),
                                  keras.layers.TimeDistributed(keras.layers.Dense(3, kernel_initializer=init,
                                                                                  bias_initializer=init))])
        model.compile(loss=keras.losses.mean_squared_error)
        x = np.random.RandomState(num_local_layers).random((1, 3)).astype("float32")
        target = np.random.RandomState(7).random((1, 3, 3)).astype("float32")
        with tf.GradientTape(persistent=True) as tape:
            loss = model.loss(target, model(x, training=True))
        from_tape = tape.gradient(loss, model.trainable_weights)
        local_layers = model.layers[:num_local_layers]
        opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.Adam(), sparse_as_dense=True,
                                                    local_layers=local_layers)
        from_opt = {id(v): g for g, v in opt._compute_gradients(loss, model.trainable_weights, tape=tape)}
        local = {id(v) for layer in local_layers for v in layer.trainable_weights}
        out[num_local_layers] = {
            "local": [np.allclose(t, hvd.size() * from_opt[id(v)])
                      for v, t in zip(model.trainable_weights, from_tape) if id(v) in local],
            "shared": [np.allclose(t, from_opt[id(v)]) and bool(np.any(t != 0))
                       for v, t in zip(model.trainable_weights, from_tape) if id(v) not in local]}
    return out


def once_case() -> dict:
    """The gradients _compute_gradients returns are reduced there; apply_gradients takes them as they are, and
    reduces any others (counted at the reducer)."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
    reduced = []
    real = opt._reducer
    opt._reducer = lambda grads, variables: reduced.append(len(grads)) or real(grads, variables)
    w = keras.Variable([1.0, 2.0])
    grads_and_vars = opt.compute_gradients(lambda: tf.reduce_sum(w * w), [w])
    opt.apply_gradients(grads_and_vars)
    after_computed = list(reduced)
    opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
    missing_tape = None
    try:
        opt._compute_gradients(tf.constant(1.0), [w])
    except ValueError as exc:
        missing_tape = [type(exc).__name__, str(exc)]
    return {"grad": grads_and_vars[0][0].numpy().tolist(), "reduced": [after_computed, reduced],
            "w": w.numpy().tolist(), "missing_tape": missing_tape}


def main() -> None:
    hvd.init()
    res = {"rank": hvd.rank(), "size": hvd.size(), "impl": hvd.IMPL, "util": util_case(),
           "aggregation": {str(avg): aggregation_case(avg) for avg in (True, False)}, "inf": inf_grad_case(),
           "partial": partial_case(), "once": once_case()}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

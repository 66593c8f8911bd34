"""Train a small Keras 3 model with ``DistributedGradientTape``; also train the single-process reference.

Every rank starts from different random weights (seeded by rank), broadcasts rank 0's, and
trains on its equal shard of a fixed data set; the averaged gradient of the shards is the
full-batch gradient, so the result must equal plain full-batch training from rank 0's
weights. The model has an Embedding, so sparse (``tf.IndexedSlices``) gradients are reduced
too. Prints ``RESULT <json>`` with both weight vectors.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.tensorflow as hvd

STEPS, N = 15, 96


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(N, 8).astype("float32")
    tokens = rng.randint(0, 10, size=(N, 1)).astype("int32")
    y = (np.argmax(x[:, :3], axis=1) + tokens[:, 0]) % 3
    return x, tokens, y.astype("int32")


def build_model() -> keras.Model:
    features, token = keras.Input((8,)), keras.Input((1,), dtype="int32")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(token))
    hidden = keras.layers.Dense(16, activation="tanh")(keras.layers.Concatenate()([features, embedded]))
    return keras.Model([features, token], keras.layers.Dense(3)(hidden))


def train(model, optimizer, x, tokens, y, distributed: bool) -> list[float]:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model([x, tokens], training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return [float(step()) for _ in range(STEPS)]


def tape_options(r: int, n: int) -> dict:
    """Gradients of ``sum(w) * (r + 1)`` and of one embedding row, through the tape's options."""
    w, table = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(tf.ones([4, 2]))

    def grads(local: bool = False, **options):
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(w) + tf.reduce_sum(tf.gather(table, [r % 4]))) * float(r + 1)
        tape = hvd.DistributedGradientTape(tape, **options)
        if local:
            tape.register_local_source(w)
        dw, dtable = tape.gradient(loss, [w, table])
        return [np.asarray(dw).tolist(), np.asarray(tf.convert_to_tensor(dtable)).tolist(),
                isinstance(dtable, tf.IndexedSlices)]

    return {"default": grads(), "predivide": grads(gradient_predivide_factor=2.0, sparse_as_dense=True), "sum": grads(op=hvd.Sum),
            "fp16": grads(compression=hvd.Compression.fp16), "groups": grads(groups=2),
            "groups_of_variables": grads(groups=[[table, w]]), "sparse_as_dense": grads(sparse_as_dense=True),
            "local": grads(local=True)}


def flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(v).ravel() for v in model.weights])


def main() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, tokens, y = data()
    keras.utils.set_random_seed(100 + r)
    model = build_model()
    hvd.broadcast_variables(model.weights, root_rank=0)
    start = [np.asarray(v) for v in model.weights]
    shard = slice(r * N // n, (r + 1) * N // n)
    losses = train(model, keras.optimizers.SGD(0.2, momentum=0.9), x[shard], tokens[shard], y[shard], True)

    reference = build_model()
    for var, value in zip(reference.weights, start):
        var.assign(value)
    train(reference, keras.optimizers.SGD(0.2, momentum=0.9), x, tokens, y, False)
    print("RESULT " + json.dumps({"rank": r, "size": n, "impl": hvd.IMPL, "losses": losses,
                                  "options": tape_options(r, n),
                                  "weights": flat(model).tolist(), "reference": flat(reference).tolist()}),
          flush=True)


if __name__ == "__main__":
    main()

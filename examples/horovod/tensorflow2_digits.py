"""A Horovod TensorFlow 2 script (custom loop, ``DistributedGradientTape``) on Keras 3.

The only change from a Horovod script is the import line. Run it on 2 processes:

    mpirun -np 2 python examples/horovod/tensorflow2_digits.py
    horovodrun -np 2 python examples/horovod/tensorflow2_digits.py   # with real Horovod installed

Data: scikit-learn's bundled 8x8 handwritten digits (no download). Each rank trains on its
shard; validation accuracy is summed over every rank's validation shard.
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import polytrain.horovod.tensorflow as hvd


def load_shards(rank: int, size: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_val, y_train, y_val = train_test_split(x, digits.target.astype("int32"), test_size=0.2,
                                                      random_state=0, stratify=digits.target)
    return (x_train[rank::size], y_train[rank::size]), (x_val[rank::size], y_val[rank::size])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.002)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # seeds Keras 3 initializers too (tf.random.set_seed does not)
    (x_train, y_train), (x_val, y_val) = load_shards(hvd.rank(), hvd.size())
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=hvd.rank())
    # Every rank must take the same number of steps (collectives pair up step by step).
    steps = int(hvd.allreduce(tf.constant(len(x_train) // args.batch_size), op=hvd.Min))
    dataset = dataset.batch(args.batch_size).take(steps)

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(args.lr * hvd.size())  # Horovod: scale the learning rate by the size

    @tf.function
    def train_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # Start every rank from rank 0's weights, once the optimizer's variables exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    step = 0
    for epoch in range(args.epochs):
        for x, y in dataset:
            loss = train_step(x, y, step == 0)
            step += 1
        correct = np.sum(np.argmax(model(x_val, training=False), axis=1) == y_val)
        totals = hvd.allreduce(tf.constant([correct, len(y_val)], tf.float64), op=hvd.Sum).numpy()
        accuracy = totals[0] / totals[1]
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f}  val_accuracy {accuracy:.4f}", flush=True)
    weights = hvd.allgather_object(float(sum(np.sum(np.asarray(w)) for w in model.weights)))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"rank": 0, "size": hvd.size(), "impl": hvd.IMPL, "val_accuracy": accuracy,
                                      "weight_sums": weights}), flush=True)


if __name__ == "__main__":
    main()

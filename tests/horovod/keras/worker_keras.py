"""Keras 3 ``model.fit`` with polytrain.horovod.keras: DistributedOptimizer, callbacks, load_model.

Each rank prints ``RESULT <json>``: the weights after fit next to a single-process fit on
the union of every rank's batches (from rank 0's initial weights), the raw and averaged
epoch losses, the learning rate seen at every batch during warm-up, the same comparison for
``backward_passes_per_step=2``, and a reload through ``hvd.load_model``. argv[1] is a
directory shared by the ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import polytrain.horovod.keras as hvd
import polytrain.horovod.tensorflow as hvd_tf

N, BATCH, EPOCHS = 96, 8, 3


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(N, 6).astype("float32")
    return x, ((x[:, 0] + x[:, 1] * x[:, 2]) > 0).astype("int32") + (x[:, 3] > 1).astype("int32")


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3)])


def flat(model) -> list[float]:
    return np.concatenate([np.asarray(v).ravel() for v in model.weights]).tolist()


class Record(keras.callbacks.Callback):
    """Copies of the epoch logs as this callback sees them, and the learning rate at every batch."""

    def __init__(self):
        super().__init__()
        self.epochs, self.lrs = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def union_batches(x, y, n: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
    """The single-process data order whose batch k is every rank's k-th ``micro`` rows, rank by rank."""
    shard = N // n
    order = [r * shard + k * micro + j for k in range(shard // micro) for r in range(n) for j in range(micro)]
    return x[order], y[order]


def fit_and_reference(x, y, r: int, n: int, passes: int) -> dict:
    """Distributed fit vs. single-process fit on the union batches (``passes`` micro-batches per update)."""
    model = build(100 + r)
    initial = hvd_tf.broadcast_object([np.asarray(v) for v in model.weights], root_rank=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     backward_passes_per_step=passes,
                                                     average_aggregated_gradients=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    raw, shard = Record(), slice(r * N // n, (r + 1) * N // n)
    history = model.fit(x[shard], y[shard], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                                   hvd.callbacks.MetricAverageCallback()])
    reference = build(0)
    for var, value in zip(reference.weights, initial):
        var.assign(value)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ux, uy = union_batches(x, y, n, BATCH)
    reference.fit(ux, uy, batch_size=BATCH * n * passes, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": flat(model), "reference": flat(reference), "history": history.history,
            "raw": raw.epochs, "iterations": int(model.optimizer.iterations.numpy())}


def warmup(x, y, r: int, n: int) -> dict:
    """Warm-up with momentum correction vs. Horovod's update written out: at every adjusted batch
    ``v = momentum * (lr / previous_lr) * v - lr * g`` on the union batch."""
    model = build(7)
    initial = [np.asarray(v) for v in model.weights]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen, shard = Record(), slice(r * N // n, (r + 1) * N // n)
    history = model.fit(x[shard], y[shard], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2), seen])

    reference, loss_fn = build(7), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for var, value in zip(reference.weights, initial):
        var.assign(value)
    ux, uy = union_batches(x, y, n, BATCH)
    velocity = [tf.zeros_like(v) for v in reference.trainable_variables]
    steps, previous = N // n // BATCH, 0.1
    for epoch in range(EPOCHS):
        for b in range(steps):
            lr = 0.1 / n * ((epoch + (b + 1) / steps) * (n - 1) / 2 + 1) if epoch < 2 else previous
            with tf.GradientTape() as tape:
                loss = loss_fn(uy[b * n * BATCH:(b + 1) * n * BATCH], reference(ux[b * n * BATCH:(b + 1) * n * BATCH]))
            grads = tape.gradient(loss, reference.trainable_variables)
            velocity = [0.9 * (lr / previous) * v - lr * g for v, g in zip(velocity, grads)]
            for var, v in zip(reference.trainable_variables, velocity):
                var.assign_add(v)
            previous = lr
    return {"lrs": seen.lrs, "epoch_lr": history.history["lr"], "weights": flat(model),
            "reference": flat(reference)}


def reload(x, y, r: int, n: int, directory: Path) -> dict:
    path = directory / "model.keras"
    model = build(3)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if r == 0:
        model.save(path)
    hvd.allreduce(0.0, name="saved")  # every rank waits for the file
    loaded = hvd.load_model(path)
    same_weights = flat(loaded) == flat(model)
    same_state = all(np.array_equal(a, b) for a, b in zip(loaded.optimizer.variables, model.optimizer.variables))
    loaded.fit(x[r::n], y[r::n], batch_size=BATCH, epochs=1, verbose=0)
    return {"optimizer": type(loaded.optimizer).__name__, "inner": type(loaded.optimizer.inner_optimizer).__name__,
            "same_weights": same_weights, "same_state": bool(same_state), "after": flat(loaded)}


def main() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = data()
    res = {"rank": r, "size": n, "impl": hvd.IMPL, "steps": N // n // BATCH}
    res["fit"] = fit_and_reference(x, y, r, n, passes=1)
    res["accumulate"] = fit_and_reference(x, y, r, n, passes=2)
    res["warmup"] = warmup(x, y, r, n)
    res["reload"] = reload(x, y, r, n, Path(sys.argv[1]))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

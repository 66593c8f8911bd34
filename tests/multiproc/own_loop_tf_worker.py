"""A hand-written TensorFlow loop and a ``model.fit`` on `polytrain.tensorflow.Distributed`, as scripts would have
them, on a small synthetic 3-class set (96 samples of 8 features, global batch 16: 6 steps an epoch, 2 epochs).

Every rank builds its models from a seed of its own, so only `setup`'s broadcast makes them start alike. The tape
loop (a Keras Sequential, Adam) runs its first epoch eagerly (the backend's own averaging hook) and its second in a
``tf.function`` (the averaging traced into the graph); ``model.fit`` (the zoo MLP, SGD with momentum) trains through
the optimizer `setup` returned. Each step's loss is averaged over the ranks; rank 0 writes the losses, the final
weights of both models, how far the ranks' weights are apart (the largest difference of any weight) and, on 2
ranks, the one line an XLA-compiled step gets. The fit model and its optimizer are saved under CKPT.

Usage: python own_loop_tf_worker.py BACKEND OUT.json CKPT [--load OTHER_CKPT]
(``--load``: afterwards, load OTHER_CKPT into a fresh zoo MLP and its optimizer and write what came back.)
"""

from __future__ import annotations

import json
import sys

import keras
import numpy as np
import tensorflow as tf

from polytrain.adapters.tensorflow.models import MLP
from polytrain.spec.zoo import model_params
from polytrain.tensorflow import Distributed, OwnLoopError

GLOBAL_BATCH, EPOCHS, FEATURES, CLASSES = 16, 2, 8, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def samples() -> tf.data.Dataset:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(96, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y))


def zoo_mlp(seed: int) -> keras.Model:
    model = MLP(FEATURES, CLASSES, model_params("mlp", {"hidden_sizes": [16]}), seed, "float32")
    model(np.zeros((1, FEATURES), np.float32))
    return model


def tape_loop(dist: Distributed) -> tuple[list[float], keras.Model, str]:
    keras.utils.set_random_seed(100 + dist.rank)  # a different start on every rank: setup sends rank 0's
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    optimizer = keras.optimizers.Adam(0.01)
    dist.broadcast_variables(model)

    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = dist.gradient(tape, loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    data = dist.shard_dataset(samples(), GLOBAL_BATCH, shuffle_buffer=96)
    losses = []
    for run in (step, tf.function(step)):  # the first epoch eagerly, the second compiled
        losses += [float(dist.all_reduce(run(x, y), "mean")) for x, y in data]
    refused = ""
    if dist.world_size > 1:
        try:
            x, y = next(iter(data))
            tf.function(step, jit_compile=True)(x, y)
        except OwnLoopError as exc:
            refused = str(exc)
    return losses, model, refused


class RankMeanLoss(keras.callbacks.Callback):
    """Each batch's running loss of the epoch (what fit logs), averaged over the ranks."""

    def __init__(self, dist: Distributed) -> None:
        super().__init__()
        self.dist, self.losses = dist, []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.losses.append(float(self.dist.all_reduce(logs["loss"], "mean")))


def fit(dist: Distributed) -> tuple[list[float], keras.Model, keras.optimizers.Optimizer]:
    model, optimizer = dist.setup(zoo_mlp(seed=dist.rank), keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=optimizer, loss=LOSS)
    record = RankMeanLoss(dist)
    model.fit(dist.shard_dataset(samples(), GLOBAL_BATCH, shuffle_buffer=96), epochs=EPOCHS, verbose=0,
              callbacks=[record])
    return record.losses, model, optimizer


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def main() -> None:
    backend, out, ckpt = sys.argv[1:4]
    dist = Distributed(backend, seed=3)
    tape_losses, tape_model, refused = tape_loop(dist)
    fit_losses, fit_model, optimizer = fit(dist)
    both = np.concatenate([flat(tape_model), flat(fit_model)])
    spread = float(np.max(dist.all_reduce(both, "max").numpy() - dist.all_reduce(both, "min").numpy()))
    saved = dist.save(ckpt, {"model": fit_model, "optimizer": optimizer, "step": EPOCHS * 6, "epoch": EPOCHS,
                             "backend": dist.backend_name})
    result = {"backend": dist.backend_name, "world": dist.world_size, "tape_losses": tape_losses,
              "fit_losses": fit_losses, "tape_weights": flat(tape_model).tolist(),
              "fit_weights": flat(fit_model).tolist(), "spread": spread, "refused": refused, "saved": str(saved)}
    if "--load" in sys.argv:
        fresh = zoo_mlp(seed=99)
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        values = dist.load(sys.argv[sys.argv.index("--load") + 1], {"model": fresh, "optimizer": opt})
        result["loaded"] = {"values": values, "weights": flat(fresh).tolist(), "iterations": int(opt.iterations)}
    if dist.is_main:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.end()


if __name__ == "__main__":
    main()

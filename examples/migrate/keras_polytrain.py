"""keras_horovod_original.py moved to `polytrain.tensorflow`: `model.fit` trains data-parallel through the
optimizer `setup` returns, on backend "horovod" (Horovod's collectives under horovodrun) or, by changing that one
argument, "mpi" or "tf-multiworker". Usage: horovodrun -np 2 python keras_polytrain.py OUT.json
"""

import sys

import keras
import numpy as np
import tensorflow as tf
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, TRAIN_SAMPLES, digits, write_result

from polytrain.tensorflow import Distributed

out = sys.argv[1]
dist = Distributed("horovod", seed=SEED)
x, y = digits()
order = np.random.default_rng(SEED).permutation(TRAIN_SAMPLES)  # one shuffle, the same on every rank
x, y = x[order].astype("float32"), y[order]
# this rank's rows of each global batch: rows rank, rank + size, ... of samples 32·i to 32·i+31
data = dist.shard_dataset(tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH)

keras.utils.set_random_seed(SEED)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
model, optimizer = dist.setup(model, keras.optimizers.SGD(LR, momentum=MOMENTUM, global_clipnorm=CLIP))
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class StepLosses(keras.callbacks.Callback):
    """The loss fit logs after each step (the epoch's running mean), averaged over the ranks."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(dist.all_reduce(np.float64(logs["loss"]), "mean")))


record = StepLosses()
model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[record])
if dist.is_main:
    write_result(out, record.losses, [], {v.path: v.numpy() for v in model.weights})
dist.end()

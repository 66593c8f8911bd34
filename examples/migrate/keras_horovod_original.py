"""The original: a Horovod Keras script (`hvd.DistributedOptimizer`, `BroadcastGlobalVariablesCallback`, each
rank fitting its share of the data). Usage: horovodrun -np 2 python keras_horovod_original.py OUT.json

On Keras 3 it runs on polytrain's Horovod-compatible Keras API with one line changed
(`import polytrain.horovod.keras as hvd`). Moved to the own-loop API: keras_polytrain.py.
"""

import sys

import horovod.tensorflow.keras as hvd
import keras
import numpy as np
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, TRAIN_SAMPLES, digits, write_result

out = sys.argv[1]
hvd.init()
x, y = digits()
order = np.random.default_rng(SEED).permutation(TRAIN_SAMPLES)  # one shuffle, the same on every rank
x, y = x[order].astype("float32"), y[order]
x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's share: every size-th sample

keras.utils.set_random_seed(SEED)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM, global_clipnorm=CLIP))
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class StepLosses(keras.callbacks.Callback):
    """The loss fit logs after each step (the epoch's running mean), averaged over the ranks."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(hvd.allreduce(np.float64(logs["loss"]), name="loss")))


record = StepLosses()
model.fit(x, y, batch_size=GLOBAL_BATCH // hvd.size(), epochs=EPOCHS, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), record])
if hvd.rank() == 0:
    write_result(out, record.losses, [], {v.path: v.numpy() for v in model.weights})

"""A Horovod Keras script (``model.fit`` with ``DistributedOptimizer`` and Horovod's callbacks) on Keras 3.

The only change from a Horovod script is the import line. Run it on 2 processes:

    mpirun -np 2 python examples/horovod/keras_digits.py
    horovodrun -np 2 python examples/horovod/keras_digits.py   # with real Horovod installed

Data: scikit-learn's bundled 8x8 handwritten digits (no download); every rank fits its shard
and validates on its validation shard; MetricAverageCallback averages the metrics.
"""

from __future__ import annotations

import argparse
import json

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import polytrain.horovod.keras as hvd


def load_shards(rank: int, size: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_val, y_train, y_val = train_test_split(x, digits.target.astype("int32"), test_size=0.2,
                                                      random_state=0, stratify=digits.target)
    shards = (x_train[rank::size], y_train[rank::size]), (x_val[rank::size], y_val[rank::size])
    return shards, len(x_train)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.002)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the broadcast callback aligns them
    ((x_train, y_train), (x_val, y_val)), n_train = load_shards(hvd.rank(), hvd.size())

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    scaled_lr = args.lr * hvd.size()  # Horovod: scale the learning rate by the number of processes
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every rank starts from rank 0's weights
        hvd.callbacks.MetricAverageCallback(),  # logged metrics are averages over the ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    # The same number of full batches on every rank: the ranks' collectives pair up step by step.
    keep = n_train // hvd.size() // args.batch_size * args.batch_size
    history = model.fit(x_train[:keep], y_train[:keep], batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_val, y_val), callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"rank": 0, "size": hvd.size(), "impl": hvd.IMPL,
                                      "val_accuracy": history.history["val_accuracy"][-1],
                                      "lr": history.history["lr"]}), flush=True)


if __name__ == "__main__":
    main()

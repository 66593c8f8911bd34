"""``hvd.elastic`` for Keras 3: ``KerasState``, the state-keeping callbacks and ``run``.

Horovod's ``horovod/tensorflow/keras/elastic.py`` semantics; the state itself is
`polytrain.horovod.tensorflow.elastic` (no pickle, commits in a private directory). Typical use::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

One difference: Keras 3's ``fit`` fixes the number of steps of every epoch when it starts, so
the first epoch after a reset runs whole (Horovod shortens it by ``state.batch`` through
``params['steps']``, which Keras 3 no longer reads; the callback still sets it).
"""

from __future__ import annotations

from typing import Any

import keras

from polytrain.horovod.tensorflow.elastic import ObjectState, TensorFlowKerasState, run


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (``model.optimizer`` by default) and plain values (``batch=0, epoch=0``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state: ObjectState, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a reset

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Set ``state.batch`` to the batch just finished; back to 0 at the end of every epoch."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` to the number of epochs finished, counted across resets (Keras restarts at 0)."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
